"""Measure kernel configurations on this GPU and pin the winners in the kernel modules.

    python benchmarks/kernels/tune.py [--write] [--json FILE] [--only attention,mhc]

Runs the sweeps of benchmarks/kernels/tune_attention.py, tune_mhc.py and tune_dense.py (each candidate checked
against the default configuration's output before it is timed; CUDA-graph replay at batch 1 and
64), prints their tables, and with --write rewrites each module's `_PINNED` table in its source
file (existing entries kept unless a new winner has the same key), so what a later process
imports, and what is committed, is what was measured. Configurations never depend on the batch
(a row's bits must not), only on the shape key of each table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

# sweep module -> kernel module whose _PINNED table it fills
TUNERS = {"attention": ("tune_attention", "megastep.kernels.attention"), "mhc": ("tune_mhc", "megastep.kernels.mhc"),
          "dense": ("tune_dense", "megastep.kernels.dense")}


def pinned_source(table: dict, indent: str = "    ") -> str:
    """The `{key: Config(...), ...}` literal of a pinned table, one entry per line, sorted by key."""
    if not table:
        return "{}"
    lines = [f"{indent}{k!r}: {v!r}," for k, v in sorted(table.items())]
    return "{\n" + "\n".join(lines) + "\n}"


def rewrite_pinned(path: Path, table: dict) -> None:
    """Replace the literal assigned to the module-level `_PINNED` in `path` by `table`."""
    src = path.read_text()
    m = re.search(r"^_PINNED(?::[^=\n]*)? = ", src, flags=re.M)
    if m is None:
        raise RuntimeError(f"no module-level _PINNED assignment in {path}")
    start = m.end()
    if src[start] != "{":
        raise RuntimeError(f"_PINNED in {path} is not a dict literal")
    depth, end = 0, start
    for i in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            end = i + 1
            break
    path.write_text(src[:start] + pinned_source(table) + src[end:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the kernel modules' _PINNED tables")
    p.add_argument("--json", help="write the winners here")
    p.add_argument("--only", default=",".join(TUNERS), help="comma-separated subset of " + ",".join(TUNERS))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tune.py measures on a CUDA device; none here")
        return 2
    dev = torch.device("cuda")
    out = {}
    for name in args.only.split(","):
        tuner_name, module_name = TUNERS[name]
        tuner, module = importlib.import_module(tuner_name), importlib.import_module(module_name)
        print(f"\n== {name}", flush=True)
        try:
            winners = tuner.sweep(dev, log=lambda *a: print(*a, flush=True))
        except Exception as e:  # one failing sweep must not cost the others
            print(f"{name}: sweep failed: {type(e).__name__}: {e}")
            continue
        table = {**module._PINNED, **winners}
        out[name] = {repr(k): repr(v) for k, v in winners.items()}
        print(f"{name} winners: {pinned_source(winners)}")
        if args.write:
            rewrite_pinned(Path(module.__file__), table)
            print(f"{name}: wrote {len(table)} entries into {module.__file__}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
