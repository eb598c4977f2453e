"""wo_a at V4-Flash shape (8 groups x [1024, 4096] FP8, no activation quantization): one grouped
launch against eight per-group launches: agreement with the ref and time (CUDA graphs, events).

python benchmarks/kernels/wo_a_grouped.py
"""

import torch
from bench_kernels import graph_time  # same folder: the kernels' shared graph-replay timer

from megastep.checkpoint import formats as F
from megastep.kernels.linear_fp8 import linear_fp8, linear_fp8_ref


def timed(fn):
    return graph_time([fn], reps=50)[0]  # median µs of event-timed graph replays


def main():
    G, R, K = 8, 1024, 4096
    w, s = F.quantize_fp8_weight(torch.randn(G * R, K, device="cuda") / K**0.5, 128)
    for M in (1, 16, 64):
        x = torch.randn(M, G * K, device="cuda").bfloat16()
        ref = linear_fp8_ref(x, w, s, quantize_act=False, groups=G)
        one = linear_fp8(x, w, s, quantize_act=False, groups=G)
        eight = lambda: torch.cat([linear_fp8(x[:, g * K:(g + 1) * K].contiguous(), w[g * R:(g + 1) * R],  # noqa: E731
                                              s[g * 8:(g + 1) * 8], quantize_act=False) for g in range(G)], -1)
        bad = ((one.float() - ref.float()).abs() > 2**-7 * ref.float().abs() + 1e-5 * ref.float().abs().max()).sum().item()
        print(f"M={M:3d} grouped==per-group launches: {torch.equal(one, eight())}  elements off the ref tolerance: {bad}  "
              f"grouped {timed(lambda: linear_fp8(x, w, s, quantize_act=False, groups=G)):.1f} us  "
              f"8 launches {timed(eight):.1f} us  (32 MB: {32e6 / 4.3e12 * 1e6:.1f} us at 4.3 TB/s)")


if __name__ == "__main__":
    main()
