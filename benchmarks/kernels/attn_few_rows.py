"""Decode attention at few rows: each shape's configuration against its few-rows plan
(attention._PINNED_FEW_ROWS: the same sums spread over more programs), at V4-Flash shapes.

    python benchmarks/kernels/attn_few_rows.py [--rows 1,2,4,8,16] [--json FILE]     (one H200, ~1 min)

For each planned shape and row count: the two outputs bit for bit (they must be equal), then us
per call of each (tune_attention's inputs and timing: CUDA graph of back-to-back calls on rotated
pool copies, so the KV comes from HBM). Prints a table last; pick the plan's row limit from it.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    kinds = {k.key: k for k in T.model_kinds()}
    rows_out = []
    for key, (limit, few) in sorted(A._PINNED_FEW_ROWS.items()):
        kind, base = kinds[key], A.pick_config(*key)
        for B in (int(b) for b in args.rows.split(",")):
            copies, n1, nb = T.copies_for(kind, B)
            inp = T.Inputs(kind, dev, B, copies, n1, nb)
            same = torch.equal(inp.run(B, base), inp.run(B, few))
            t = {}
            for name, cfg in (("base", base), ("few", few)):
                fns = [lambda a=a, kw=kw, cfg=cfg: A.sparse_attention_pools(*a, **kw, config=cfg) for a, kw in inp.calls[B]]
                t[name] = BK.graph_time(fns, reps=T.REPS)[0]
            rows_out.append(dict(kind=kind.name, key=list(key), limit=limit, B=B, same_bits=same, base_us=t["base"],
                                 few_us=t["few"], base=T.short(base), few=T.short(few)))
            print(json.dumps(rows_out[-1]), flush=True)
            del inp
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    print(f"\n{'kind':6} {'B':>3} {'base us':>9} {'few us':>9} same  (base | few; plan used up to {'/'.join(str(r['limit']) for r in rows_out[:1])} rows)")
    for r in rows_out:
        print(f"{r['kind']:6} {r['B']:3} {r['base_us']:9.1f} {r['few_us']:9.1f} {r['same_bits']}  ({r['base']} | {r['few']})")


if __name__ == "__main__":
    main()
