"""Decode attention launched two ways that must give the same sums, at V4-Flash shapes: bit for bit,
then timed.

    python benchmarks/kernels/attn_few_rows.py [--compare few|hint] [--rows 1,2,4,8,16] [--json FILE]
                                                                                   (one H200, ~1 min)

--compare few (the default): each planned shape's configuration against its few-rows plan
(attention._PINNED_FEW_ROWS: the same sums spread over more programs). Pick the plan's row limit
from the table.
--compare hint: each attention kind's configuration with and without the KV rows' 16-byte
alignment hint (attention's ROWS16). Without it Triton 3.9 loads the CSA and HCA KV tiles 2 bytes
per instruction: 3646 SASS instructions per thread per 32-entry step and 255 registers with spills
at the CSA pin, against 1099 and 107 with it (`sass_loop.py attention --dv 4`). On one H200 with
Triton 3.6 both took the same time (2026-11-30, docs/PERFORMANCE.md eighteenth measurement): 3.6
keeps the alignment without the hint. Run this again when the device's Triton changes;
`rows16_off()` is also a step benchmark's arm without the hint (h200_checks.sh `bench_with`).

For each shape and row count: the two outputs bit for bit (they must be equal), then us per call
of each (tune_attention's inputs and timing: CUDA graph of back-to-back calls on rotated pool
copies, so the KV comes from HBM). Prints a table last.
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


def arms(compare: str, rows: list[int]):
    """(kind, B, note, [(name, config, switch), (name, config, switch)]) to compare."""
    kinds = {k.key: k for k in T.model_kinds()}
    if compare == "few":
        for key, (limit, few) in sorted(A._PINNED_FEW_ROWS.items()):
            base = A.pick_config(*key)
            for B in rows:
                yield kinds[key], B, f"plan used up to {limit} rows", [("base", base, rows16_on), ("few", few, rows16_on)]
    else:
        for kind in kinds.values():
            for B in rows:
                cfg = A.pick_config(*kind.key, B)
                yield kind, B, "", [("hint", cfg, rows16_on), ("no_hint", cfg, rows16_off)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", default="few", choices=["few", "hint"])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    for kind, B, note, two in arms(args.compare, [int(b) for b in args.rows.split(",")]):
        copies, n1, nb = T.copies_for(kind, B)
        inp = T.Inputs(kind, dev, B, copies, n1, nb)
        y, t = {}, {}
        for name, cfg, switch in two:
            switch()
            y[name] = inp.run(B, cfg)
            fns = [lambda a=a, kw=kw, cfg=cfg: A.sparse_attention_pools(*a, **kw, config=cfg) for a, kw in inp.calls[B]]
            t[name] = BK.graph_time(fns, reps=T.REPS)[0]
        rows16_on()
        (na, ca, _), (nb_, cb, _) = two
        out.append({"kind": kind.name, "key": list(kind.key), "B": B, "note": note, "same_bits": torch.equal(y[na], y[nb_]),
                    "arms": [na, nb_], f"{na}_us": t[na], f"{nb_}_us": t[nb_], na: T.short(ca), nb_: T.short(cb)})
        print(json.dumps(out[-1]), flush=True)
        del inp
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for r in out:
        a, b = r["arms"]
        print(f"{r['kind']:10} {r['B']:3}  {a} {r[f'{a}_us']:8.1f} us  {b} {r[f'{b}_us']:8.1f} us  same {r['same_bits']}  "
              f"({r[a]} | {r[b]}{'; ' + r['note'] if r['note'] else ''})")


if __name__ == "__main__":
    main()
