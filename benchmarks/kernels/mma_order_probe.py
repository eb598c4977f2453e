"""Does one tensor-core k16 step's fp32 result depend on the order of its 16 products inside the
instruction, or on the instruction? (One H200, ~30 s.)

    python benchmarks/kernels/mma_order_probe.py [--trials 4096] [--json FILE]

Why: the FP8 linears close ~71 us of a 1-row CSA layer against ~32 us of bytes (docs/PERFORMANCE.md,
eighteenth measurement). Triton's loop streams at ~3 TB/s; the CUDA GEMV (gemv_fp8_cuda.cu) reached
3.8 at M = 1 by feeding each lane's 16 contiguous weight bytes to mma.sync in a K order of its own,
but the runtime keeps one linear for every batch size (a row's bits must not depend on its batch),
and that kernel's bits are not Triton's. If a k16 step gives the same bits whatever the order of
its products and whichever instruction runs it (Triton's dot on Hopper is wgmma; mma.sync is what
a hand-written small-M loop uses), a CUDA loop for few rows can keep the Triton kernel's bits as
long as it keeps the same products in the same k16 steps and the same fp32 chain around them.

What runs, on random data (`fp16`: any fp16 values over 16 binades, signs mixed; `e4m3`: the e4m3
values the FP8 linear feeds its dots, as fp16; C: fp32 over a wider range, some zeros):
- Triton: D = tl.dot(A [64, 16], B [16, 16], C) with 4 warps (its PTX is checked for wgmma);
- mma.sync m16n8k16 (mma_order_probe.cu) with the products in the natural order, reversed, in
  pairs swapped across the instruction's halves, and in random orders.
Every pair is compared bit for bit. For the probe's power: how often the natural order differs from
the exact sum (float64, rounded once to fp32) and from a left-to-right fp32 sum. A probe whose data
never shows order effects there could not see them in the tensor core either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megastep.kernels.cuda_module import CudaModule  # noqa: E402

_MODULE = CudaModule(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mma_order_probe.cu"))
E4M3_MAX = 448.0


@triton.jit
def _dot_k16(a_ptr, b_ptr, c_ptr, d_ptr):
    t = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, 64)
    k = tl.arange(0, 16)
    a = tl.load(a_ptr + t * 1024 + m[:, None] * 16 + k[None, :])
    b = tl.load(b_ptr + t * 256 + k[:, None] * 16 + k[None, :])
    c = tl.load(c_ptr + t * 1024 + m[:, None] * 16 + k[None, :])
    tl.store(d_ptr + t * 1024 + m[:, None] * 16 + k[None, :], tl.dot(a, b, c))


def data(kind: str, trials: int, g: torch.Generator, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def fp16(*shape):
        mant = 1 + torch.rand(*shape, generator=g)
        exp = torch.randint(-8, 8, shape, generator=g).float()
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        return (sign * mant * torch.exp2(exp)).half()

    def e4m3(*shape):
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).half()

    make = fp16 if kind == "fp16" else e4m3
    a, b = make(trials, 64, 16), make(trials, 16, 16)
    scale = torch.exp2(torch.randint(-12, 12, (trials, 64, 16), generator=g).float())
    c = torch.randn(trials, 64, 16, generator=g) * scale
    c[torch.rand(trials, 64, 16, generator=g) < 0.1] = 0.0
    return a.to(dev), b.to(dev), c.to(dev)


def exact(a, b, c) -> torch.Tensor:
    return (torch.einsum("tmk,tkn->tmn", a.double(), b.double()) + c.double()).float()


def left_to_right(a, b, c) -> torch.Tensor:
    acc = c.float().clone()
    for k in range(16):
        acc = acc + (a[:, :, k:k + 1].float() * b[:, k:k + 1, :].float())  # products exact in fp32
    return acc


def differ(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.view(torch.int32) != y.view(torch.int32)).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4096)
    ap.add_argument("--json")
    a_ = ap.parse_args()
    dev = torch.device("cuda")
    kernel = _MODULE.kernel("mma_k16_perm", "pppppi")
    g = torch.Generator().manual_seed(0)
    orders = {"natural": list(range(16)), "reversed": list(range(15, -1, -1)),
              "halves swapped": list(range(8, 16)) + list(range(8))}
    for i in range(5):
        orders[f"random {i}"] = torch.randperm(16, generator=g).tolist()
    out = []
    for kind in ("fp16", "e4m3"):
        a, b, c = data(kind, a_.trials, g, dev)
        d_tri = torch.empty_like(c)
        compiled = _dot_k16[(a_.trials,)](a, b, c, d_tri, num_warps=4)
        wgmma = "wgmma" in compiled.asm["ptx"]
        got = {}
        for name, perm in orders.items():
            d = torch.empty_like(c)
            kernel.launch((-(-a_.trials // 4), 1, 1), (128, 1, 1), 0, None, a, b, c,
                          torch.tensor(perm, dtype=torch.int32, device=dev), d, a_.trials)
            got[name] = d
        torch.cuda.synchronize()
        nat = got["natural"]
        ex, l2r = exact(a, b, c), left_to_right(a, b, c)
        row = {"kind": kind, "trials": a_.trials, "triton_uses_wgmma": wgmma,
               "triton_vs_mma_natural": differ(d_tri, nat),
               **{f"mma_{name}_vs_natural": differ(d, nat) for name, d in got.items() if name != "natural"},
               "mma_natural_vs_exact": differ(nat, ex),
               # a wrong fragment layout would show here: far more than fp32 rounding
               "mma_natural_max_err_rel": ((nat - ex).abs().max() / ex.abs().max()).item(),
               "mma_natural_vs_left_to_right": differ(nat, l2r),
               "exact_vs_left_to_right": differ(ex, l2r)}
        out.append(row)
        print(json.dumps(row), flush=True)
    if a_.json:
        with open(a_.json, "w") as f:
            json.dump(out, f, indent=1)
    print("\nfraction of fp32 outputs whose bits differ (0 = the same bits everywhere)")
    for r in out:
        print(f"{r['kind']}: Triton dot (wgmma: {r['triton_uses_wgmma']}) against mma.sync natural order "
              f"{r['triton_vs_mma_natural']:.2e}")
        for k, v in r.items():
            if k.startswith("mma_") and k.endswith("_vs_natural"):
                print(f"  mma.sync {k[4:-11]} order against natural {v:.2e}")
        print(f"  mma.sync natural order: largest error {r['mma_natural_max_err_rel']:.1e} of max|exact|")
        print(f"  power: natural against exact {r['mma_natural_vs_exact']:.2e}, against left-to-right fp32 "
              f"{r['mma_natural_vs_left_to_right']:.2e} (exact against left-to-right {r['exact_vs_left_to_right']:.2e})")


if __name__ == "__main__":
    main()
