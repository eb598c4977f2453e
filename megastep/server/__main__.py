"""`python -m megastep.server ...`: the same as `megastep serve ...`."""

import argparse
import sys

from megastep.server import add_serve_arguments, serve_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megastep.server",
                                     description="OpenAI-compatible megastep server")
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
