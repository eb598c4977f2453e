"""How many passes the "lut" experts kernels make over the routed experts' weights, modeled without a GPU.

A pass of an item streams an expert's weight rows once for at most `moe_lut.PAIRS_PER_PASS` of the
expert's pairs (rows routed to it); an expert with more pairs is streamed again. The kernels' loop is
bound by its own instructions, so a second pass costs about what the first did. This script routes M
rows through the gates of the synthetic V4-Flash (the bench's weights, drawn on the CPU: the same
distribution, other values than the device's draw) with random unit-RMS activations
(`routing.random_routes`, as `routing.profile_from_random_activations` does for the bench's expected
expert counts; hash layers: random token ids), and counts per layer the experts read and the passes
(`bench.expert_passes`) at 2, 4 and 8 pairs a pass.

    python benchmarks/expert_passes.py --rows 1,16,32,64 --routing default,skewed --layers 30

On 2026-12-07 it gave 75.1 / 172.8 experts a layer at 16 / 64 rows under the default routing, against the
75.3 / 171.1 that the bench's rows read on the H200 (docs/PERFORMANCE.md, section of 2026-12-06 from 23:36).
"""

from __future__ import annotations

import argparse

import torch

from megastep.bench import expert_passes
from megastep.checkpoint.synthetic import preset, synthesize_tensors
from megastep.kernels import moe_lut
from megastep.routing import ROUTING_MODELS, gate_prefix, random_routes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--routing", default="default,skewed")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--draws", type=int, default=8, help="random row sets per row count")
    ap.add_argument("--seed", type=int, default=0, help="the synthetic weights' seed (the bench's --seed)")
    args = ap.parse_args()
    cfg = preset("v4-flash", layers=args.layers)
    widths = sorted({moe_lut.PAIRS_PER_PASS, 4, 8})
    print(f"v4-flash, {args.layers} layers; per layer: experts read, passes at {moe_lut.PAIRS_PER_PASS} pairs a pass "
          f"(the kernels'), passes per expert read at {', '.join(map(str, widths))} pairs a pass, most pairs on one expert")
    for routing in args.routing.split(","):
        if routing not in ROUTING_MODELS:
            raise SystemExit(f"--routing: {routing!r} is not one of {', '.join(ROUTING_MODELS)}")
        names = []
        for L in range(cfg.num_hidden_layers):
            p = gate_prefix(L)
            names += [p + ".tid2eid"] if cfg.is_hash_layer(L) else [p + ".weight", p + ".bias"]
        gates = dict(synthesize_tensors(cfg, args.seed, include_mtp=False, names=names, routing=routing))
        for rows in (int(r) for r in args.rows.split(",")):
            read, most, by_width = 0, 0, dict.fromkeys(widths, 0)
            for d in range(args.draws):
                for L in range(cfg.num_hidden_layers):
                    c = torch.bincount(random_routes(cfg, gates, L, rows, d, tag="rows").flatten().long(),
                                       minlength=cfg.n_routed_experts)
                    c = c[c > 0].tolist()
                    read += len(c)
                    most = max(most, max(c))
                    for w in widths:
                        by_width[w] += expert_passes(c, w)
            n = args.draws * cfg.num_hidden_layers
            per = ", ".join(f"{by_width[w] / read:.3f}" for w in widths)
            print(f"{routing:8s} {rows:3d} rows: {read / n:6.1f} experts, {by_width[moe_lut.PAIRS_PER_PASS] / n:6.1f} "
                  f"passes; per expert {per}; most {most}", flush=True)


if __name__ == "__main__":
    main()
