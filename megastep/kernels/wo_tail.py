"""The attention sublayer's output projection, wo_a then wo_b, for a few rows in ONE persistent CUDA
C++ launch (`wo_tail.cu`), with the bits of linear_fp8's two Triton launches.

Shapes and dtypes: o bf16 [M, G*Ka] (M <= MAX_ROWS; the attention's output, G groups of Ka
columns), wo_a e4m3 [G*R, Ka] + e8m0 scale [G*R/128, Ka/128] (grouped: output rows [g R, (g+1) R)
read o's columns [g Ka, (g+1) Ka); the activation is not quantized), wo_b e4m3 [N, G*R] + e8m0
scale [N/128, G*R/128] (fp8 activation quantization) -> out bf16 [M, N]. The intermediate u = wo_a(o)
is rounded to bf16 as linear_fp8's output is. V4-Flash: G 8, Ka 4096, R 1024, N 4096.

Why: at one row each projection streams its 33.5 MB at ~2.3 TB/s in its own launch against ~4.3
measured (docs/PERFORMANCE.md, twenty-eighth measurement: wo_a 14.1 us, wo_b 14.7 in the 1-row HCA
sublayer; 7.7-8.0 at the streaming read). A launch ramps up and drains, HBM idles at the boundary,
and the Triton loop issues each program's loads in a few stages. Here every warp keeps a ring of
sub-tile copies in flight over both projections, and wo_b's tasks start on u's first group while
wo_a finishes the others. The .cu says how: tasks by ticket (no co-residency assumed), x copied with
its weights when it exists, the Triton loop's arithmetic, split order.

Reference: `wo_tail_ref` (linear_fp8_ref twice). `plan` says which launches take it; `check` raises
if a wait in it gave up (it never should: the .cu says why).

Off (`ENABLED`): measured slower. Built 2026-12-05 without a device; the same day on one H100
(benchmarks/h200_checks.sh `wotail`, docs/PERFORMANCE.md "2026-12-05 from 10:52 UTC") its 85 GPU
tests passed at once (linear_fp8's bits at every shape, entry, row count, grid and PDL setting, in a
graph and in the step), but the pair alone took 42.4-46.4 us at one row against 34.7 for the two
Triton launches (51.7 % of the streaming read at best against 63.2 %), 45.6-61.5 against 36.1-36.3
at 2 and 4 rows, and the 16-layer step was 2.6-8.8 % slower at 1-4 rows. The chain probe in the same
session put every per-warp cp.async ring below Triton's launches too, persistent or not: the copy
structure, not the launch boundary, is what loses. Kept for its tested persistence (tickets, the
groups of u, late slots), which a loader that streams faster (bulk/TMA copies) could reuse.
"""

from __future__ import annotations

import functools
import os

import torch

from megastep.kernels import linear_fp8 as _lin
from megastep.kernels.common import pdl_enabled, sm_count, workspace
from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wo_tail.cu")
_MODULE = CudaModule(SOURCE)
_SIGNATURE = "pqppppppqppppiiiiiiiii"
# (warps per CTA, ring slots per warp, bytes of K per sub-tile): the .cu's entries
ENTRIES = ((8, 4, 256), (8, 3, 256), (12, 2, 256), (8, 2, 512), (8, 4, 128))
_KERNELS = {e: _MODULE.kernel(f"wo_tail_w{e[0]}_r{e[1]}_kc{e[2]}", _SIGNATURE) for e in ENTRIES}
ENABLED = False  # the step's wo_a -> wo_b of <= MAX_ROWS rows through this launch (measured slower: docstring)
# 32 sub-tiles of 4 KB in flight per SM (~128 KB: ~4 us of its share of HBM). Of the entries, (12, 2,
# 256) lost least in the step on one H100 (+2.6 / +3.3 / +5.3 % at 1 / 2 / 4 rows).
ENTRY = (8, 4, 256)
# Launched with PDL when the step uses it (its CTAs placed while the attention drains copy their
# first sub-tiles' weights, then wait), or plainly (False: placed once the attention completes; the
# staged linear's early CTAs slowed the attention beside them, docs/PERFORMANCE.md). Measured on one
# H100 (16 layers, 1 / 2 / 4 rows): plain +6.3 / +6.5 / +8.8 % against +5.5 / +5.6 / +8.4 % with PDL.
PDL = True
MAX_ROWS = 4  # the .cu's kRows
MAX_GROUPS = 16  # the .cu's kMaxGroups
_PAD = 16  # the .cu's kPad
_QUEUE = 8  # the .cu's kQueue


@functools.cache
def _have_nvcc() -> bool:
    return find_nvcc() is not None


def shared_bytes(entry: tuple[int, int, int]) -> int:
    """Dynamic shared memory of a CTA: per warp, R slots (16 weight rows and MAX_ROWS x rows of KC,
    padded), the sub-tile's x scales, the posted tickets and the slots' late marks."""
    w, r, kc = entry
    slot = 16 * kc + MAX_ROWS * (kc + _PAD) * 2
    return w * (r * slot + MAX_ROWS * (kc // 128) * 4 + _QUEUE * 4 + r * 4)


def splits(M: int, wa: torch.Tensor, wb: torch.Tensor) -> tuple[int, int]:
    """wo_a's and wo_b's K splits: linear_fp8's own for these shapes (so the same partial sums)."""
    (na, ka), (nb, kb) = wa.shape, wb.shape
    return (ka // _lin.split_cols(ka, _lin.pick_config(M, na, ka)),
            kb // _lin.split_cols(kb, _lin.pick_config(M, nb, kb)))


def plan(o: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, groups: int,
         entry: tuple[int, int, int] | None = None) -> tuple[int, int, int] | None:
    """The entry that runs wo_b(wo_a(o)) for these operands, or None: ENABLED, a CUDA device with
    nvcc, bf16 o of 1..MAX_ROWS rows on 16-byte rows, FP8 weights of 128-blocks whose splits are
    whole multiples of the entry's sub-tile, wo_b's K = G R, and G <= MAX_GROUPS. `entry` (default
    ENTRY) must be one of ENTRIES."""
    if not ENABLED or o.device.type != "cuda" or not _have_nvcc():
        return None
    return fits(o, wa, wb, groups, entry or ENTRY)


def fits(o: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, groups: int,
         entry: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """`plan`'s operand checks (any device): `entry` when the kernel takes these operands, else None."""
    if entry not in _KERNELS:
        return None
    M = o.shape[0]
    if o.dtype != torch.bfloat16 or not 0 < M <= MAX_ROWS or o.stride(1) != 1 or o.stride(0) % 8 \
            or o.data_ptr() % 16:
        return None
    if wa.dtype != torch.float8_e4m3fn or wb.dtype != torch.float8_e4m3fn or not 0 < groups <= MAX_GROUPS:
        return None
    (na, ka), (nb, kb) = wa.shape, wb.shape
    if o.shape[1] != groups * ka or kb != na or na % groups or (na // groups) % 128 or nb % 128 or ka % 128:
        return None
    kc = entry[2]
    if any(k % s or (k // s) % kc for k, s in zip((ka, kb), splits(M, wa, wb))):
        return None
    return entry


def sync_words(groups: int, rank: int, n: int) -> int:
    """The launch's counters (the .cu's sync[]): tickets, warps out, u's groups, the row tiles' split
    arrivals of both projections."""
    return 2 + MAX_GROUPS + groups * rank // 16 + n // 16


def wo_tail(o: torch.Tensor, wa: torch.Tensor, sa: torch.Tensor, wb: torch.Tensor, sb: torch.Tensor, groups: int,
            entry: tuple[int, int, int], ctas: int | None = None) -> torch.Tensor:
    """out [M, N] bf16 = wo_b(wo_a(o)) for a `plan` accepted (its entry). ctas: the grid (default one
    CTA per SM; fewer or more give the same bits)."""
    M = o.shape[0]
    (na, ka), nb = wa.shape, wb.shape[0]
    sa_, sb_ = splits(M, wa, wb)
    dev = o.device
    u = workspace(dev, "wo_tail_u", MAX_ROWS * na, torch.bfloat16)
    pa = workspace(dev, "wo_tail_pa", sa_ * MAX_ROWS * na, torch.float32)
    pb = workspace(dev, "wo_tail_pb", sb_ * MAX_ROWS * nb, torch.float32)
    sync = workspace(dev, "counters_wo_tail", sync_words(groups, na // groups, nb), torch.int32)
    err = workspace(dev, "counters_wo_tail_err", 1, torch.int32)
    out = torch.empty(M, nb, dtype=torch.bfloat16, device=dev)
    w, r, kc = entry
    # each warp's first tasks, its own (no ticket): as many as the ring's first sub-tiles, copied
    # before the launch may touch the ticket counter
    first = -(-r // (min(ka // sa_, na // sb_) // kc))
    pdl = pdl_enabled() and PDL
    _KERNELS[entry].launch((ctas or sm_count(dev), 1, 1), (32 * w, 1, 1), shared_bytes(entry), None,
                           o, o.stride(0), wa.view(torch.uint8), sa.view(torch.uint8), wb.view(torch.uint8),
                           sb.view(torch.uint8), u, out, out.stride(0), pa, pb, sync, err,
                           M, groups, na // groups, ka, nb, sa_, sb_, first, int(pdl), pdl=pdl)
    return out


def check(device: torch.device) -> None:
    """Raise if a wait of a launch on `device` since the last check gave up (~2 s); resets the word.
    Syncs. (Nothing to check where no launch ran.)"""
    err = workspace(torch.device(device), "counters_wo_tail_err", 1, torch.int32)
    if int(err[0]):
        err.zero_()
        raise RuntimeError("the wo_a -> wo_b launch gave up waiting for u (~2 s): its output is wrong")


def wo_tail_ref(o: torch.Tensor, wa: torch.Tensor, sa: torch.Tensor, wb: torch.Tensor, sb: torch.Tensor,
                groups: int) -> torch.Tensor:
    """The semantics: linear_fp8's reference for wo_a (grouped, no activation quantization, bf16
    out) and then for wo_b."""
    u = _lin.linear_fp8_ref(o, wa, sa, quantize_act=False, groups=groups)
    return _lin.linear_fp8_ref(u, wb, sb)
