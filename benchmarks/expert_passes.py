"""How many passes the "lut" experts kernels make over the routed experts' weights, modeled without a GPU.

A pass of an item streams an expert's weight rows once for at most `moe_lut.PAIRS_PER_PASS` of the
expert's pairs (rows routed to it); an expert with more pairs is streamed again. The kernels' loop is
bound by its own instructions, so a second pass costs about what the first did. This script routes M
rows through the gates of the synthetic V4-Flash (the bench's weights, drawn on the CPU: the same
distribution, other values than the device's draw) with random unit-RMS activations, as
`routing.profile_from_random_activations` does for the bench's expected expert counts (hash layers:
random token ids), and counts per layer the experts read and the passes at 2, 4 and 8 pairs a pass.

    python benchmarks/expert_passes.py --rows 1,16,32,64 --routing default,skewed --layers 30

On 2026-12-07 it gave 75.1 / 172.8 experts a layer at 16 / 64 rows under the default routing, against the
75.3 / 171.1 that the bench's rows read on the H200 (docs/PERFORMANCE.md, section of 2026-12-06 from 23:36).
"""

from __future__ import annotations

import argparse

import torch

from megastep.checkpoint.synthetic import preset, synthesize_tensors, tensor_seed
from megastep.kernels import moe_lut
from megastep.routing import ROUTING_MODELS, _gate_scores, gate_prefix


def layer_routes(cfg, gates: dict[str, torch.Tensor], L: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, top_k] expert ids of layer L for `rows` random rows."""
    p = gate_prefix(L)
    if cfg.is_hash_layer(L):
        g = torch.Generator().manual_seed(tensor_seed(seed, f"{p}/rows-tokens"))
        return gates[p + ".tid2eid"][torch.randint(0, cfg.vocab_size, (rows,), generator=g)]
    scores = _gate_scores(gates[p + ".weight"], rows, tensor_seed(seed, f"{p}/rows-acts"))
    return (scores + gates[p + ".bias"].float()).topk(cfg.num_experts_per_tok, dim=-1).indices


def passes(counts: torch.Tensor, per_pass: int) -> int:
    return int(((counts + per_pass - 1) // per_pass).sum())


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
                    c = torch.bincount(layer_routes(cfg, gates, L, rows, d).flatten().long(),
                                       minlength=cfg.n_routed_experts)
                    c = c[c > 0]
                    read += len(c)
                    most = max(most, int(c.max()))
                    for w in widths:
                        by_width[w] += passes(c, w)
            n = args.draws * cfg.num_hidden_layers
            per = ", ".join(f"{by_width[w] / read:.3f}" for w in widths)
            print(f"{routing:8s} {rows:3d} rows: {read / n:6.1f} experts, {by_width[moe_lut.PAIRS_PER_PASS] / n:6.1f} "
                  f"passes; per expert {per}; most {most}", flush=True)


if __name__ == "__main__":
    main()
