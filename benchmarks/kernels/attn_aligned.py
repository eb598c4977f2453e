"""Decode attention with and without the 16-byte row alignment hint (attention's ROWS16), at the
V4-Flash shapes of each attention kind.

    python benchmarks/kernels/attn_aligned.py [--rows 1,4,64] [--json FILE]     (one H200, ~1 min)

Without the hint Triton 3.9 loads the CSA and HCA KV tiles 2 bytes per instruction (the select between
window and compressed rows hides their alignment): 3646 SASS instructions per thread per 32-entry
step and 255 registers with spills at the pinned CSA configuration, against 1099 and 107 with it
(`sass_loop.py attention --dv 4`, Triton 3.9). For each kind and row count: both outputs bit for bit
(they must be equal: the same loads, sums and order), then us per call of each (tune_attention's
inputs and timing). `rows16_off()` was also the step benchmark's arm without the hint
(h200_checks.sh attn16 at fadb572). On one H200 with Triton 3.6 both were the same (2026-11-30,
docs/PERFORMANCE.md eighteenth measurement): 3.6 keeps the alignment without the hint; rerun this
when the device's Triton changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402
import tune_attention as T  # noqa: E402
from megastep.kernels import attention as A  # noqa: E402

_KERNEL = A._sparse_attn_kernel


class _HintOff:
    """The attention kernel launched with ROWS16 = False whatever the launcher found."""

    def __getitem__(self, grid):
        run = _KERNEL[grid]

        def call(*args, **kwargs):
            kwargs["ROWS16"] = False
            return run(*args, **kwargs)

        return call


def rows16_off() -> None:
    A._sparse_attn_kernel = _HintOff()


def rows16_on() -> None:
    A._sparse_attn_kernel = _KERNEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,64")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    for kind in T.model_kinds():
        cfg = A.pick_config(*kind.key)
        for B in (int(b) for b in args.rows.split(",")):
            copies, n1, nb = T.copies_for(kind, B)
            inp = T.Inputs(kind, dev, B, copies, n1, nb)
            t, y = {}, {}
            for name, switch in (("hint", rows16_on), ("no_hint", rows16_off)):
                switch()
                y[name] = inp.run(B, A.pick_config(*kind.key, B))
                fns = [lambda a=a, kw=kw: A.sparse_attention_pools(*a, **kw) for a, kw in inp.calls[B]]
                t[name] = BK.graph_time(fns, reps=T.REPS)[0]
            rows16_on()
            out.append(dict(kind=kind.name, key=list(kind.key), B=B, config=T.short(cfg),
                            same_bits=torch.equal(y["hint"], y["no_hint"]), hint_us=t["hint"], no_hint_us=t["no_hint"]))
            print(json.dumps(out[-1]), flush=True)
            del inp
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{'kind':10} {'B':>3} {'hint us':>9} {'no hint':>9} same")
    for r in out:
        print(f"{r['kind']:10} {r['B']:3} {r['hint_us']:9.1f} {r['no_hint_us']:9.1f} {r['same_bits']}")


if __name__ == "__main__":
    main()
