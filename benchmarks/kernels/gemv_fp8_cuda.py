"""An experiment, not used by the runtime: the FP8 block-scaled decode linear in CUDA C++
(`gemv_fp8_cuda.cu`), with the semantics of `megastep.kernels.linear_fp8.linear_fp8_ref` /
`linear_fp8_swiglu_ref` (activation fp8-quantized per 128 channels with power-of-two scales, exact
products against the e4m3 weight and its E8M0 128x128 scales, fp32 sums, one rounding to the
output dtype; SwiGLU and residual epilogues). Measured by gemv_variants.py and launch_floor.py.

The question it answers: are the decode GEMVs slow because Triton's loop issues too many
instructions per byte (the sixth measurement's reading)? Here each lane feeds the MMA's A operand
straight from 16-byte global loads in a K order of our choosing (Triton cannot be told to), and the
loop is ~28 warp-instructions per KB of weight against Triton's ~125-217. Answer (one H200,
2026-11-29, docs/PERFORMANCE.md "seventh measurement"): only partly. At M = 1 it streams large
weights faster (wo_b 13.5 against 15.2-15.8 us; the fit over sizes 3.8 against 3.0 TB/s) but its
fixed cost per launch is no lower (5.2 against 4.5 us), so small shapes are no faster, and at
M = 4..64 the per-CTA activation quantization and shared-memory B operand make it 1.1-9x slower.
The runtime keeps one linear for every batch size (a row's bits must not depend on the batch), so
the kernel is not used.

Tiling (weight [N, K], x [M, K]):
- a warp owns 16 output channels (for SwiGLU: 16 of w1 and, in the next warp, the same 16 of w3) and
  the CTA's K range of `128 * NB` channels; R such tiles per CTA (one warp each);
- gridDim.z = S = K / (128 NB) CTAs split K; their fp32 partials are summed in split order by the
  last CTA to arrive (arrival counter; no atomics on data), which loads all S partials at once;
- gridDim.x covers M in groups of MG = 8 NT rows (the MMA's n side), the fastest grid index, so
  the groups of one weight tile run together and share it through L2.
NB (hence S and every row's order of sums) depends on the weight's shape only; NT and R on M too,
but they do not change any row's sums: a row gets the same bits alone or in a batch of 64
(checked by gemv_variants.py on the GPU).

The wgmma form (`GemvConfig.wg`, built 2026-12-07 without a device): the 7th measurement's
reading put the kernel's loss at 4-64 rows on the per-CTA x work and the B operand it loads from shared
memory for every 8 rows (one mma.sync per 8 rows and k16 step). There each group of 4 warps (64
consecutive output channels) issues one wgmma.m64nNk16 per k16 step, N = the CTA's 8 NT rows of x, A
(the weight) from the same registers, B (x) read by the tensor cores from shared memory, staged once per
CTA in the swizzled layout Triton gives its own wgmma operand. The same K order, per-block arithmetic and
split-K, so a row's sums do not depend on M either; its bits are the mma form's only if wgmma's k16 step
gives mma.sync's sums (`gemv_variants.py` reports both). N a multiple of 16 R (every warp of a group
active); gated (since 2026-12-08) in 8 warps, w1's 4 tiles on warps 0-3 and the same tiles of w3 on 4-7.
The question it answers: can one kernel family for every row count keep the 1-row gain (wo_b 13.5
against 15.2-15.8 us) and match Triton at 4-64 rows?
Answer on one H100 (docs/PERFORMANCE.md, 2026-12-07 from 20:23 UTC, item 4): correct, batch-invariant and bit
for bit the mma form's, but no faster (wo_b 50.97 us at 16 rows against the mma form's 36.39 and Triton's 18.49):
the MMAs were not the 4-64-row loss. The prologue's x loads, a warp waiting for each task's in turn, are the
reading since; they now go out kU = 4 tasks at a time (not yet measured). The staged form (`GemvConfig.cp`,
entries `gemv_fp8_wgc_*`, built 2026-12-08 without a device) takes that reading to its end: each thread issues
cp.async copies of its share of the CTA's x slice (bf16, fp32 or codes with their scales) into shared memory
beside the weight's first loads, and one wait covers them all, so the conversion reads shared memory only:
one round trip to L2 a CTA whatever the rows (more shared memory: the slice as given).

The cluster combine (`GemvConfig.cl`, entries `gemv_fp8_cl{S}_*` and `gemv_fp8_wgc_cl{S}_*`, 2026-12-08, not
measured): the S K splits of a tile are one thread-block cluster, and their partials are summed from each other's
shared memory (DSMEM) in split order after a cluster barrier, each CTA taking every S-th output, in place of the
partials' trip through global memory, the arrival counter and the last CTA's loads. The question: how much of
the fixed ~5 us a launch (seventh measurement) is the split-K combine? (The first version's combine, its partials
loaded 8 at a time, made 6.3 us of difference.) Same sums in the same order: the bits of the global combine.
Entries for S = 4 (NB 4 and 8: shared w2, w1/w3) and S = 8 (NB 8: wo_b).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megastep.kernels.common import workspace
from megastep.kernels.cuda_module import CudaModule, CudaUnavailable

BLOCK = 128
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_fp8_cuda.cu")
_MODULE = CudaModule(_SOURCE, arch="sm_90a")  # wgmma (the wg entries) needs sm_90a
_SIGNATURE = "pqippqqipqpqpqipqippiiif"
_KERNELS: dict[tuple[CudaModule, int, int, bool, bool, int], object] = {}
_PAD = 8  # fp16 elements of padding per shared x row (the .cu's kPad)
SMEM_LIMIT = 96 * 1024  # dynamic shared memory per CTA we allow (two CTAs per SM still fit)
TARGET_WARPS = 1024  # split K until tiles x splits reaches this (~8 warps per SM)
TARGET_CTAS = 264  # two CTAs per SM of the 132
MAX_SPLIT = 32  # CTAs along K at most: the .cu's kMaxSplit (the last CTA loads all partials at once)
CLUSTERS = {(4, 4), (4, 8), (8, 8)}  # (splits, NB) with cluster-combine entries (the .cu's GEMV_FP8_CL)


@dataclass(frozen=True)
class GemvConfig:
    nb: int  # 128-blocks of K per CTA (shape only)
    nt: int  # 8-row groups of x per CTA
    r: int  # row tiles (w1/w3 pairs when gated) per CTA
    wg: bool = False  # the wgmma form (r 4 or 8: groups of 4 warps)
    cp: bool = False  # with wg: the staged form (x's slice copied to shared memory in one round trip)
    cl: bool = False  # the K splits one cluster, combined through DSMEM (the mma or the staged form; CLUSTERS)

    @property
    def mg(self) -> int:
        return 8 * self.nt


def _smem(nt: int, nb: int, warps: int, wg: bool = False, stage: int = 0) -> int:
    """stage: bytes of an x element staged as given (the staged form: 1 codes, 2 bf16, 4 fp32), else 0."""
    mg = 8 * nt
    if wg:  # 1 KB to align the swizzled tiles, 2 halves of mg x 128 bytes per block, the scales, the slice
        codes = 1024 + nb * 2 * mg * 128 + mg * nb * 4 + mg * nb * BLOCK * stage
    else:
        codes = mg * (BLOCK * nb + _PAD) * 2 + mg * nb * 4
    return max(codes, warps * 16 * mg * 4)


def pick_nb(n_tiles: int, K: int) -> int:
    """128-blocks per CTA: the largest of 8, 4, 2, 1 dividing K/128 whose split gives at least
    TARGET_WARPS warps, else the smallest (the most split). Depends on the shape only."""
    cands = [nb for nb in (8, 4, 2, 1) if K % (BLOCK * nb) == 0 and K // (BLOCK * nb) <= MAX_SPLIT]
    for nb in cands:
        if n_tiles * (K // (BLOCK * nb)) >= TARGET_WARPS:
            return nb
    return cands[-1]


def pick_config(M: int, N: int, K: int, gated: bool = False) -> GemvConfig:
    """N: output channels (I when gated). Deterministic; no autotuning."""
    G = 2 if gated else 1
    tiles = N // 16
    nb = pick_nb(tiles * G, K)
    nt = next(t for t in (1, 2, 4, 8) if 8 * t >= M or t == 8)
    r = 8 // G
    while nt > 1 and _smem(nt, nb, r * G) > SMEM_LIMIT:
        nt //= 2
    splits, mgroups = K // (BLOCK * nb), -(-M // (8 * nt))
    while r > 1 and -(-tiles // r) * splits * mgroups < TARGET_CTAS:
        r //= 2
    return GemvConfig(nb, nt, r)


def pick_config_wg(M: int, N: int, K: int, cp: bool = False, gated: bool = False) -> GemvConfig:
    """The wgmma form's configuration: pick_config's K split and row groups, 8 warps (two groups of 4)
    unless too few CTAs, then 4; gated always 4 pairs (8 warps). cp: the staged form, its row groups sized
    for a bf16 x."""
    c = pick_config(M, N, K, gated)
    r = 8 if (N // 16) % 8 == 0 and -(-(N // 16) // 8) * (K // (BLOCK * c.nb)) * -(-M // c.mg) >= TARGET_CTAS else 4
    r = 4 if gated else r
    nt = c.nt
    while nt > 1 and _smem(nt, c.nb, r * (2 if gated else 1), True, 2 if cp else 0) > SMEM_LIMIT:
        nt //= 2
    return GemvConfig(c.nb, nt, r, True, cp)


def cluster_ok(cfg: GemvConfig, K: int) -> bool:
    """Whether the cluster combine has an entry for cfg's form and K split."""
    return (K // (BLOCK * cfg.nb), cfg.nb) in CLUSTERS and cfg.wg == cfg.cp


def _kernel(module: CudaModule, nt: int, nb: int, wg: bool = False, cp: bool = False, cluster: int = 0):
    """cluster: the cluster entry's splits, or 0 for the global combine."""
    k = _KERNELS.get((module, nt, nb, wg, cp, cluster))
    if k is None:
        form = ("wgc_" if cp else "wg_") if wg else ""
        name = f"gemv_fp8_{form}{f'cl{cluster}_' if cluster else ''}nt{nt}_nb{nb}"
        k = _KERNELS[(module, nt, nb, wg, cp, cluster)] = module.kernel(name, _SIGNATURE)
    return k


_AVAILABLE: bool | None = None
_WHY = ""


def available() -> bool:
    """True where the kernel can be built (nvcc, the driver); the first call builds it."""
    global _AVAILABLE, _WHY
    if _AVAILABLE is None:
        try:
            _MODULE.cubin()
            _AVAILABLE = True
        except CudaUnavailable as e:
            _AVAILABLE, _WHY = False, str(e)
    return _AVAILABLE


def why_unavailable() -> str:
    return _WHY


def gemv_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    gated: bool = False,
    limit: float = 0.0,
    residual: torch.Tensor | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: GemvConfig | None = None,
    module: CudaModule = _MODULE,
) -> torch.Tensor:
    """module: a build of gemv_fp8_cuda.cu (launch_floor.py's timing probes pass edited ones).
    x [M, K] bf16/fp32 (or its x_codes), w e4m3 [N, K] (gated: [2N, K] = cat(w1, w3)), w_scale
    e8m0 [rows/128, K/128] -> out [M, N] (bf16 or fp32), as `linear_fp8` / `linear_fp8_swiglu`.
    K a multiple of 128, N of 16 (gated: of 128), 16-byte aligned rows (not checked here); on a
    device of compute capability >= 8.9. Launches on the current stream."""
    M, N = out.shape
    K = w.shape[1]
    cfg = config or pick_config(M, N, K, gated)
    G = 2 if gated else 1
    warps = cfg.r * G
    splits = K // (BLOCK * cfg.nb)
    assert splits <= MAX_SPLIT and K % (BLOCK * cfg.nb) == 0, (K, cfg)
    # the wgmma form: groups of 4 warps, each warp of a group active (wgmma is issued by all four)
    assert not cfg.wg or (cfg.r in ((4,) if gated else (4, 8)) and (N // 16) % cfg.r == 0 and N % 16 == 0), (N, cfg)
    assert not cfg.cp or cfg.wg, cfg
    grid = (-(-M // cfg.mg), -(-(N // 16) // cfg.r), splits)
    codes = x_codes is not None
    xc, xs = x_codes if codes else (out, out)
    eb = 1 if codes else x.element_size()
    if cfg.cp:  # 16-byte copies of each row's K slice
        src, row = (xc, xc.stride(0)) if codes else (x, x.stride(0) * eb)
        assert src.data_ptr() % 16 == 0 and row % 16 == 0, "the staged form copies 16-byte aligned rows"
    smem = _smem(cfg.nt, cfg.nb, warps, cfg.wg, eb if cfg.cp else 0)
    assert not cfg.cl or cluster_ok(cfg, K), (K, cfg)
    if splits > 1 and not cfg.cl:
        cta = grid[0] * grid[1]
        part = workspace(x.device, "partials", splits * cta * warps * 16 * cfg.mg, torch.float32)
        cnt = workspace(x.device, "counters", cta, torch.int32)
    else:
        part = cnt = out  # unused
    res = residual if residual is not None else out
    res_mode = 0 if residual is None else (1 if residual.dtype == torch.float32 else 2)
    _kernel(module, cfg.nt, cfg.nb, cfg.wg, cfg.cp, splits if cfg.cl else 0).launch(
        grid, (32 * warps, 1, 1), smem, None,
        x, x.stride(0), int(x.dtype == torch.float32), xc, xs, xc.stride(0), xs.stride(0), int(codes),
        w, w.stride(0), w_scale, w_scale.stride(0), out, out.stride(0), int(out.dtype == torch.bfloat16),
        res, res.stride(0), res_mode, part, cnt, M, N, int(gated), float(limit),
    )
    return out
