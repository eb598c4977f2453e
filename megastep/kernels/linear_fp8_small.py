"""The FP8 block-scaled decode linear for a few rows in CUDA C++ (`linear_fp8_small.cu`), with the
bits of `linear_fp8`'s Triton "f16" loop: `linear_fp8._launch` hands it a launch of at most ROWS
rows (where `supported`), and every row gets the same bits from either kernel, so a row's bits
still do not depend on its batch.

Shapes and dtypes: x [M, groups * K] bf16/fp32 (or its x_codes), w e4m3 [N, K] (gated: [2N, K] =
cat(w1, w3)), w_scale e8m0 [rows/128, K/128] -> out [M, N] bf16/fp32; plain, gated (SwiGLU) or
residual epilogues, with or without the activation quantization (wo_a), as `linear_fp8`.

Why it exists: at batch 1 the Triton loop issues ~146 warp-instructions per KB of weight (~110 with
x_codes; SASS of Triton 3.6, benchmarks/kernels/sass_loop.py) and streams at ~3.0 TB/s past a ~4.5
us fixed cost. A hand-written loop that feeds the weight bytes straight from its loads into
mma.sync (benchmarks/kernels/gemv_fp8_cuda.py, seventh measurement) issues far fewer, but took a K
order of its own, so its bits were not Triton's and it could not serve one batch size beside
Triton at another. This one keeps Triton's order:
- each 128-block's dot is 8 k16 tensor-core steps over the columns [16j, 16j + 16), j in order,
  from zero, as Triton's tl.dot of the block; inside a step the products sit in other slots, which
  changes no bit: a k16 step's fp32 result depends on the set of its products only, and mma.sync
  gives wgmma's bits (benchmarks/kernels/mma_order_probe.py, one H200, 2026-11-30: 0 of 262144
  outputs differ over random and reversed orders, fp16 and e4m3 operands);
- the same split of K (Triton's `k_per_split`), acc += dot * (activation scale * weight scale) in
  block order, the splits summed in split order 0..S-1, and the epilogue's operations one by one
  (`_epilogue`; the SwiGLU's exp is libdevice's, as Triton compiles it).
GPU tests compare the two loops bit for bit at every V4-Flash shape and 1..16 rows
(tests/kernels/test_linear_fp8_small.py).

Tiling: a warp owns 16 output channels over one split's K range (gated: a w1 tile and, in the next
warp, the same w3 tile); R tiles per CTA, R halved until the grid has TARGET_CTAS CTAs or R is 1;
gridDim.x covers M in groups of 8 (M <= 8) or 16 rows. Built by nvcc at the first call
(`cuda_module`), before any graph capture (the runtime's warm-up steps make that call).
"""

from __future__ import annotations

import os

import torch

from megastep.kernels.common import launch_opts, workspace
from megastep.kernels.cuda_module import CudaModule, CudaUnavailable

BLOCK = 128
# Launches of at most ROWS rows take this kernel, for the weight shapes (N, K) in SHAPES (None:
# every shape it supports). 0: never (until measured in the step on an H200).
ROWS = 0
SHAPES: frozenset[tuple[int, int]] | None = None
# How a lane gets its weight words (the .cu's LOAD): "word" 4-byte loads; "shfl" 16-byte loads and a
# transpose over the quad; "ldsm" 16-byte cp.async into a shared-memory ring, then ldmatrix.
LOADS = ("word", "shfl", "ldsm")
LOAD = "shfl"
_STAGES = 4  # the .cu's kStages: blocks of 2 KB per warp in the "ldsm" ring
MAX_ROWS = 16  # the .cu's n-tiles: NT 1 or 2
MAX_SPLIT = 32  # the .cu's kMaxSplit
TARGET_CTAS = 264  # two CTAs per SM of the 132
_PAD = 8  # fp16 elements of padding per shared x row (the .cu's kPad)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_fp8_small.cu")
_MODULE = CudaModule(_SOURCE)
_SIGNATURE = "pqippqqipqpqpqipqippiiiiiifi"
_KERNELS: dict[tuple[str, int, int], object] = {}
_AVAILABLE: bool | None = None


def available() -> bool:
    """True where the kernel can be built and loaded (nvcc, the driver); the first call builds it."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            _MODULE.cubin()
            _AVAILABLE = True
        except CudaUnavailable:
            _AVAILABLE = False
    return _AVAILABLE


def supported(x: torch.Tensor, w: torch.Tensor, M: int, N: int, K: int, k_per_split: int, mode: str,
              rows: int | None = None, shapes: frozenset[tuple[int, int]] | None = None,
              x_codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether a linear_fp8 launch (its Triton configuration's mode and split) may take this kernel:
    at most `rows` (default ROWS) rows of a weight shape in `shapes` (default SHAPES), "f16" mode,
    whole 128-blocks and splits of 1, 2, 4 or 8 blocks, 16-row output tiles, 16-byte aligned weight
    rows, activation rows aligned for the kernel's vector loads (8 bytes bf16, 16 fp32, 4 codes),
    on a CUDA device where the kernel builds."""
    rows = ROWS if rows is None else rows
    shapes = SHAPES if shapes is None else shapes
    if not (0 < M <= min(rows, MAX_ROWS)) or mode != "f16" or x.device.type != "cuda":
        return False
    if shapes is not None and (N, K) not in shapes:
        return False
    if K % k_per_split or k_per_split // BLOCK not in (1, 2, 4, 8) or K // k_per_split > MAX_SPLIT or N % 16:
        return False
    if w.stride(0) % 16 or w.data_ptr() % 16 or x.stride(0) % (4 if x.dtype == torch.float32 else 4) or \
            x.data_ptr() % 16:
        return False
    if x_codes is not None and any(t.stride(0) % 4 or t.data_ptr() % 4 for t in x_codes):
        return False
    return available()


def _shared_bytes(nt: int, nb: int, warps: int, load: str) -> int:
    mg = 8 * nt
    codes = -(-(mg * (BLOCK * nb + _PAD) * 2 + mg * nb * 4) // 16) * 16
    ring = warps * _STAGES * 2048 if load == "ldsm" else 0
    return max(codes + ring, warps * 16 * mg * 4)


def _ctas(M: int, N: int, K: int, k_per_split: int, gated: bool, group_n: int) -> tuple[int, int]:
    """(nt, r): 8-row groups of x and 16-row tiles per CTA; neither changes a row's sums."""
    G = 2 if gated else 1
    nt = 1 if M <= 8 else 2
    r = 8 // G
    while group_n % (16 * r):  # a CTA's tiles read one group of x
        r //= 2
    tiles, splits, mgroups = N // 16, K // k_per_split, -(-M // (8 * nt))
    while r > 1 and -(-tiles // r) * splits * mgroups < TARGET_CTAS:
        r //= 2
    return nt, r


def launch(x, w, w_scale, out, k_per_split: int, quantize_act: bool, groups: int, gated: bool, limit: float,
           residual, x_codes) -> torch.Tensor:
    """linear_fp8's launch (`_launch`'s arguments, after `supported`) on the current stream."""
    M, N = out.shape
    K = w.shape[1]
    nb = k_per_split // BLOCK
    group_n = N // groups
    nt, r = _ctas(M, N, K, k_per_split, gated, group_n)
    warps = r * (2 if gated else 1)
    splits = K // k_per_split
    grid = (-(-M // (8 * nt)), -(-(N // 16) // r), splits)
    if splits > 1:
        ctas = grid[0] * grid[1]
        part = workspace(x.device, "partials", splits * ctas * warps * 16 * 8 * nt, torch.float32)
        cnt = workspace(x.device, "counters", ctas, torch.int32)
    else:
        part = cnt = out  # unused
    codes = x_codes is not None and quantize_act
    xc, xs = x_codes if codes else (out, out)
    res = residual if residual is not None else out
    res_mode = 0 if residual is None else (1 if residual.dtype == torch.float32 else 2)
    opts = launch_opts(x, grid, w.numel() * w.element_size())
    assert LOAD in LOADS, LOAD
    kernel = _KERNELS.get((LOAD, nt, nb))
    if kernel is None:
        kernel = _KERNELS[(LOAD, nt, nb)] = _MODULE.kernel(f"linear_fp8_small_{LOAD}_nt{nt}_nb{nb}", _SIGNATURE)
    kernel.launch(
        grid, (32 * warps, 1, 1), _shared_bytes(nt, nb, warps, LOAD), None,
        x, x.stride(0), int(x.dtype == torch.float32), xc, xs, xc.stride(0), xs.stride(0), int(codes),
        w, w.stride(0), w_scale.view(torch.uint8), w_scale.stride(0), out, out.stride(0),
        int(out.dtype == torch.bfloat16), res, res.stride(0), res_mode, part, cnt, M, N, K, group_n,
        int(quantize_act), int(gated), float(limit), opts["PDL"], pdl=opts["launch_pdl"],
    )
    return out
