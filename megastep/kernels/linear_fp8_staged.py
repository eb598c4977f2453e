"""The FP8 block-scaled decode linear of at most 16 rows, in CUDA C++ with its weights staged in
shared memory before its input exists (`linear_fp8_staged.cu`): linear_fp8's plain launches (no
SwiGLU pair, no residual), the same bits as its Triton "f16" loop.

Shapes and dtypes: x bf16 [M, G*K] (M <= 16), w e4m3 [N, K], w_scale e8m0 [N/128, K/128] ->
out [M, N] bf16 or fp32; G groups as linear_fp8's (output rows [g N/G, (g+1) N/G) read x's columns
[g K, (g+1) K)). quantize_act as linear_fp8's (False: wo_a's bf16 activation scaled into fp16).

Why: a weight never depends on the kernel before it. Launched with PDL, a CTA placed while its
predecessor drains copies all of its weight bytes into shared memory first, then waits; once the
input is there only the MMAs remain. Meant for wo_a behind the attention, which at one row is
bound by one warp's chain and leaves HBM idle (docs/PERFORMANCE.md: the 1-row timeline, wo_a 14.3
us after the attention's 16). The .cu says how its sums are Triton's: the launch's split of K,
each 128-block's dot over Triton's k16 column sets, blocks and splits summed in Triton's order, so
a row's bits do not depend on which of the two kernels ran (the batch-invariance rule) and this one
may take only the launches of few rows.

Reference: `linear_fp8_staged_ref`, which is linear_fp8's (`linear_fp8_ref`).

Off by default: `SHAPES` lists the (N, K, groups) launches that take it at most 16 rows. Built on
2026-12-04 without a device; measured 2026-12-05 (docs/PERFORMANCE.md, twenty-eighth measurement):
its GPU tests pass (48 of them), and the 30-layer step is 2.4-4.7 % slower at 1-4 rows with wo_a (and
wo_b) through it. Its waiting CTAs slow the one-wave attention beside them by ~5 us, and once released
it streams wo_a no faster than the Triton loop (14.8 against 14.0 us): the loop, not HBM, bounds
these linears at few rows, so staging earlier buys nothing. Kept, off, for a loop that is HBM-bound.
"""

from __future__ import annotations

import functools
import os

import torch

from megastep.kernels.common import pdl_enabled, sm_count, workspace
from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_fp8_staged.cu")
_MODULE = CudaModule(SOURCE)
_SIGNATURE = "pqpqpqpqippiiiiiii"
_KERNELS = {(nt, nb, w): _MODULE.kernel(f"linear_fp8_staged_nt{nt}_nb{nb}_w{w}", _SIGNATURE)
            for nt in (1, 2) for nb in (1, 2, 4, 8) for w in (4, 8)}
# Warps per CTA, each 16 output channels (the .cu's W: 4 or 8). 8: a wo_a CTA takes 144.5 KB of
# shared memory, one per SM (beside one CSA attention program); 4: 80.5 KB, two per SM, so one
# CTA's copies overlap the other's MMAs where no predecessor leaves time. Not measured yet.
WARPS = 8
# Under PDL the next kernel's CTAs may be placed once every CTA of this launch has started (True)
# or once each has read all of its weights (False): True lets a staged launch behind this one (wo_b
# behind wo_a) copy its weights while this one computes. Not measured yet.
RELEASE_AT_ENTRY = False
# The CTAs of a launch's first wave (one per SM slot) prefetch the later waves' weights into L2 at
# entry, while the predecessor runs and HBM idles, so those CTAs copy from L2 (one
# `cp.async.bulk.prefetch.L2` per weight row; no value changes). wo_a in CTAs of 8 warps is ~2 waves
# (256 CTAs of 128 KB at one per SM). Measured with wo_a: no faster (the module's docstring).
PREFETCH_LATER_WAVES = False
MAX_ROWS = 16  # rows of x per CTA: 8 (NT 1) or 16 (NT 2)
MAX_SPLIT = 32  # the .cu's kMaxSplit
# (N, K, groups) of the linear_fp8 launches that take this kernel at <= MAX_ROWS rows. Empty: none
# (wo_a's, (8192, 4096, 8), measured as a module setting: slower; the module's docstring).
SHAPES: frozenset[tuple[int, int, int]] = frozenset()


@functools.cache
def _have_nvcc() -> bool:
    return find_nvcc() is not None


def supported(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: a CUDA device, and nvcc to build it."""
    return device.type == "cuda" and _have_nvcc()


def shared_bytes(nt: int, nb: int, warps: int) -> int:
    """Dynamic shared memory of a CTA: its warps' weights (16 rows x 128 nb bytes each), x's codes
    in fp16 (8 nt rows, padded) and their scales."""
    return warps * 16 * 128 * nb + 8 * nt * (128 * nb + 8) * 2 + 8 * nt * nb * 4


def plan(x: torch.Tensor, w: torch.Tensor, groups: int, k_per_split: int, mode: str,
         residual: torch.Tensor | None) -> tuple[int, int, int, int] | None:
    """(nt, nb, warps, split) when linear_fp8's launch over x [M, G*K] and w [N, K], split into K columns
    of k_per_split, takes this kernel, else None: a listed shape on a CUDA device with nvcc, bf16 x,
    at most 16 rows, the "f16" mode, no residual, 128-row CTAs within one group, whole 128-blocks
    of 1-8 per split, at most MAX_SPLIT splits, rows that start on 16 bytes (its vector loads); the
    CTAs of WARPS warps."""
    N, K = w.shape
    if (N, K, groups) not in SHAPES or residual is not None or mode != "f16":
        return None
    M = x.shape[0]
    if not supported(x.device) or x.dtype != torch.bfloat16 or not 0 < M <= MAX_ROWS:
        return None
    if x.data_ptr() % 16 or x.stride(0) % 8 or w.data_ptr() % 16 or w.stride(0) % 16:
        return None
    nb, split, warps = k_per_split // 128, K // k_per_split, WARPS
    if (N // groups) % (16 * warps) or k_per_split % 128 or K % k_per_split or nb not in (1, 2, 4, 8) \
            or split > MAX_SPLIT:
        return None
    return (1 if M <= 8 else 2), nb, warps, split


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, quantize_act: bool,
           groups: int, plan_: tuple[int, int, int, int]) -> torch.Tensor:
    """out = linear_fp8(x, w, w_scale, ...) for a launch `plan` accepted; returns out."""
    nt, nb, warps, split = plan_
    M, N = out.shape
    assert x.stride(1) == 1 and w.stride(1) == 1 and out.stride(1) == 1
    grid = (-(-M // (8 * nt)), N // (16 * warps), split)
    ctas = grid[0] * grid[1]
    if split > 1:
        part = workspace(x.device, "partials_staged", split * ctas * 16 * warps * 8 * nt, torch.float32)
        cnt = workspace(x.device, "counters_staged", ctas, torch.int32)
    else:
        part = cnt = out  # unused
    pdl = pdl_enabled()
    mode = (2 if RELEASE_AT_ENTRY else 1) if pdl else 0  # the .cu's pdl: 0 off, 1 release after the loop, 2 at entry
    # the .cu's pf: the first wave's CTAs, at least one per SM (more: the same bytes asked twice)
    pf = sm_count(x.device) if PREFETCH_LATER_WAVES else 0
    _KERNELS[(nt, nb, warps)].launch(grid, (32 * warps, 1, 1), shared_bytes(nt, nb, warps), None,
                              x, x.stride(0), w.view(torch.uint8), w.stride(0), w_scale.view(torch.uint8),
                              w_scale.stride(0), out, out.stride(0), int(out.dtype == torch.bfloat16), part, cnt,
                              M, N, w.shape[1], N // groups, int(quantize_act), mode, pf, pdl=pdl)
    return out


def linear_fp8_staged_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, quantize_act: bool = True,
                          groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The semantics: linear_fp8's reference (imported here: linear_fp8 imports this module)."""
    from megastep.kernels.linear_fp8 import linear_fp8_ref

    return linear_fp8_ref(x, w, w_scale, out_dtype=out_dtype, quantize_act=quantize_act, groups=groups)
