"""User-facing errors: anything the user can fix (a bad checkpoint, a bad prompt, a bad flag).

The CLI and the server turn a `UserError` into one clear message and a non-zero exit / a 4xx
answer; any other exception is a bug in megastep and keeps its traceback.
"""

import argparse
import contextlib
import math
import os


class UserError(Exception):
    """A problem with the user's input, reported as one message without a traceback."""


class CheckpointError(UserError):
    """The checkpoint on disk does not match what its config promises."""


class ConfigError(UserError):
    """config.json is missing, malformed or describes a model megastep does not run."""


def check_output_file(path: str, flag: str) -> None:
    """A UserError now if `path` cannot become a file: its folder missing or not writable, or a folder
    in its place. Called before the work whose result goes there, so that a typo does not cost a
    benchmark's or a profile's run at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write into {folder}")


def check_output_folder(path: str, flag: str) -> None:
    """A UserError now if `path` cannot become (or be written as) a folder: a file in its place, or
    its nearest existing parent not a writable folder."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise UserError(f"{flag} {path}: a file is in the way; give a folder")
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p) or not os.access(p, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write into {p}")


def comma_ints(text: str, problem: str) -> list[int]:
    """'1, 4,16' -> [1, 4, 16] (blanks dropped, empty items skipped); text that is not that raises
    UserError(problem)."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(problem) from None


AUTO = "auto"  # --hbm-budget auto (runtime/experts.auto_budget_bytes)


def budget_arg(value: str) -> float | str:
    """argparse type of --hbm-budget: decimal GB >= 0, or "auto"."""
    if value == AUTO:
        return AUTO
    try:
        gb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of GB or '{AUTO}', got {value!r}") from None
    if not math.isfinite(gb) or gb < 0:
        raise argparse.ArgumentTypeError(f"a finite number of GB >= 0 or '{AUTO}', got {value!r}")
    return gb


@contextlib.contextmanager
def writing(what: str):
    """An OSError while writing `what` (a full disk, a folder removed meanwhile) becomes one UserError
    that says what was being written; whatever was written before it stays."""
    try:
        yield
    except OSError as e:
        raise UserError(f"writing {what} failed: {e.strerror or e}") from None
