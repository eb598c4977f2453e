"""The routed MXFP4 experts' weight launches in CUDA C++ (`moe_lut.cu`): mode "lut" of
`kernels/moe.py`, whose `moe_experts_table` calls these two functions in place of its Triton
gate-up and down kernels (routing, the activation quantization between them and the reference,
`moe_experts_mxfp4_ref`, are moe.py's).

Shapes and dtypes (P = M * topk pairs, E experts, table strides in bytes):
    gate_up: xq bf16 [M, D] (x quantized, natural order) -> act bf16 [P, I]
    down:    aq bf16 [P, I] (act quantized, natural order) -> y bf16 [P, D] per pair, and with
             combine the fp32 [M, D] sum over each row's slots in slot order
D and I multiples of 512, x in bf16 (`supported`). Why CUDA C++: the decode is a shared-memory
table lookup whose address one `prmt` forms (in the ring gate-up, for half of the groups, a
register decode: RING_MIX), and in down each lane's MMA operands stay in its registers with a
block-diagonal B so every MXFP4 group's scale multiplies only its own sum, while gate-up's
group-major kernel takes its weights back from shared memory by ldmatrix so that an MMA's k16 is
one group (the .cu explains all three); Triton expresses none of it. Measured against the Triton
"dot_asm" kernels in docs/PERFORMANCE.md (tenth measurement).

Grids are static, so launches are captured by CUDA graphs. Every gate-up and down launch takes the
group-major kernels (GATE_UP_GM, DOWN_GM; a device with their shared memory): one CTA of GM_WARPS warps
per SM, taking (expert slot, 128 channels of gate-up or 256 rows of w2) items in turn, or for gate-up
launches of M in GM_SPREAD_ROWS rows the warps' tasks dealt out evenly, or in GM_FEW_ROWS rows (1) dealt out
to GM_FEW_WARPS-warp CTAs whose warp pairs take a task's two K halves. Without them (other bits), the
pair-major kernels: at most 2 CTAs of 256 threads per SM, each taking (expert slot, 128 weight rows)
items in turn, each warp streaming whole rows; gate-up launches of M in SPREAD_ROWS rows deal the
warps' tasks out evenly over one CTA per SM instead, and those of ring_rows(M) take one CTA of 512
threads per SM whose halves run items apart: the same bits. Build and load
happen at the first call (`cuda_module`), which must come before any capture (the runtime's warm-up
steps do it).
When the step uses PDL (`common.pdl_enabled()`, read at launch) both launch with programmatic
stream serialization: gate-up builds its decode table while the router drains, down also
requests its first weights before the activation quantization has finished (the .cu's `run`
says why that is safe). Measured on one H200: -0.15 ms per 30-layer step at 1 row (5.60 -> ~5.45)
(docs/PERFORMANCE.md, eleventh measurement).
"""

from __future__ import annotations

import functools
import os

import torch

from megastep.kernels.common import pdl_enabled
from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_lut.cu")
_MODULE = CudaModule(SOURCE)
_GATE_UP = _MODULE.kernel("moe_gate_up_lut", "pqppppppppqiiqqfiii")
_GATE_UP_SPREAD = _MODULE.kernel("moe_gate_up_lut_spread", "pqppppppppqiiqqfiiii")
_DOWN = _MODULE.kernel("moe_down_lut", "pqpppppppqpqpiiqqiiipq")
_DOWN4 = _MODULE.kernel("moe_down_lut4", "pqpppppppqpqpiiqqiiipq")
_GATE_UP_RING = _MODULE.kernel("moe_gate_up_lut_ring", "pqppppppppqiiqqfiii")
_GATE_UP_SPREAD_RING = _MODULE.kernel("moe_gate_up_lut_spread_ring", "pqppppppppqiiqqfiiii")
_GATE_UP_RING_MIX = _MODULE.kernel("moe_gate_up_lut_ring_mix", "pqppppppppqiiqqfiii")
_GATE_UP_SPREAD_RING_MIX = _MODULE.kernel("moe_gate_up_lut_spread_ring_mix", "pqppppppppqiiqqfiiii")
_GATE_UP_GM = _MODULE.kernel("moe_gate_up_gm", "pqppppppppqiiqqfiii")
_GATE_UP_GM_SPREAD = _MODULE.kernel("moe_gate_up_gm_spread", "pqppppppppqiiqqfiiii")
_GATE_UP_GM_FEW = _MODULE.kernel("moe_gate_up_gm_few", "pqppppppppqiiqqfiiiii")
_DOWN_GM = _MODULE.kernel("moe_down_gm", "pqpppppppqpqpiiqqiiipq")
_DOWN_GM_EARLY = _MODULE.kernel("moe_down_gm_early", "pqpppppppqpqpiiqqiiipq")
THREADS = 256
# an item of a CTA (its 8 warps, 16 MMA rows each, over the whole K): gate-up ITEM_CHANNELS
# channels of w1 and the same of w3, down ITEM_ROWS rows of w2 (the .cu's kWarps x 8 and x 16)
ITEM_CHANNELS, ITEM_ROWS = 64, 128
CTAS_PER_SM = 2  # the kernels' __launch_bounds__ minimum (registers and shared memory allow 2)
# A pass of an item streams its weight rows once for at most this many of the expert's pairs (the
# .cu's run: 2 pairs share an MMA's 8 columns, 4 columns each for the block-diagonal x); an
# expert with more pairs streams its rows again (from L2 or HBM) for every further 2. (gate-up's;
# down in launches of DOWN4_MIN_ROWS rows or more: twice as many.)
PAIRS_PER_PASS = 2
# Pair-major down launches (DOWN_GM off, or no room for it) of at least this many rows take moe_down_lut4:
# passes of 4 pairs, each decoded weight fragment feeding two MMAs (pairs 0-1 and 2-3), so an expert with 3-4
# pairs streams its rows once.
# The same sums for every pair, so the same bits (GPU test). Why: the experts' loop is bound by its
# instructions and a pass costs about the same whatever its bytes; at 64 rows the synthetic gates'
# routing makes 1.43 passes per expert read, 1.09 at 4 pairs a pass (benchmarks/expert_passes.py), and
# the experts' time per pass was the same at 16 and 64 rows on one H200 (docs/PERFORMANCE.md,
# 2026-12-06 from 23:36). Measured on one H100, 16 layers, the step with it on every launch against
# off, 3 rounds (docs/PERFORMANCE.md, 2026-12-07 from 02:10): -1.16 / -3.06 / -5.72 % at 16 / 32 / 64
# rows, -7.08 % at 64 rows under the skewed routing (the bits: its GPU test passed there); below 16
# rows (the same machine kind, 2026-12-07 from 07:53): +0.74 / +0.60 / +0.15 / -0.91 % at 1 / 2 / 4 / 8
# rows, and again -1.24 / -2.96 / -5.56 % at 16 / 32 / 64: from 8 rows on. (gate-up in passes of 4 pairs,
# without the ring's slots, which leave no room for 4 rows of x, lost 10-22 % of the step at 16-64
# rows: the code at 210ceff.) None: off.
# Needs 64 KB + 8 I + 8 KB of shared memory (shared_bytes).
DOWN4_MIN_ROWS: int | None = 8
LUT_BYTES = 256 * 256  # the decode table: 256 entries x 32 lanes' copies, 256 B apart
EXP_BYTES = 1024  # the .cu's kExpBytes: after the table, RING_MIX's x block exponents
# Gate-up launches of these row counts (at most 2: every expert slot then has at most 2 pairs)
# take moe_gate_up_lut_spread: one CTA of SPREAD_WARPS warps per SM, the warps' (slot, 8
# channels) tasks dealt out evenly (the .cu's run_spread). The same bits. Measured on one H200
# (docs/PERFORMANCE.md, fifteenth measurement), 30-layer step: 2 rows 6.23-6.24 ms against
# 6.34-6.38 with whole items; 1 row no faster (5.034-5.037 against 5.017-5.033), also with the
# shared expert's w1/w3 in 2-warp programs (5.026-5.034 against 5.002-5.038, sixteenth
# measurement). () turns it off (benchmarks/kernels/moe_cuda_variants.py's engine "lut_items").
SPREAD_ROWS = (2,)
SPREAD_WARPS = 12  # the .cu's kSpreadWarps
# moe_gate_up_lut_ring (the .cu's RingStream) for gate-up launches of 1 row or at least
# RING_MIN_ROWS rows (ring_rows): one CTA of 2 x 256 threads per SM whose halves take items as two
# CTAs would, sharing one decode table, so that each warp's weight steps in flight live in shared
# memory (RING_DEPTH 2 KB slots, cp.async) instead of registers (2 steps). The same bits. Built
# 2026-12-01 because the experts' loop waits on its weights (ncu's stall samples). Measured on one
# H200 (docs/PERFORMANCE.md, twenty-second measurement), 30-layer step, ring against none, A/B/A/B:
# 1 row -0.9 %, 4 rows +0.9 %, 8 rows -2.1 %, 16 -3.3 %, 32 -3.4 %, 64 -3.5 % (2 rows take the
# spread gate-up). A whole 512-thread CTA per SM keeps the side stream's launches off an SM until
# it is free, which is what costs at 4 rows (gate-up alone: +0.5-1.8 %). (down through the ring
# was 12-27 % slower per call and is not built.) None: never. A device with less shared memory per
# CTA than the ring needs (224 KB at D = 4096) keeps the register ring.
RING_MIN_ROWS: int | None = 8
RING_DEPTH = 4  # the .cu's kRingDepth
# A 1-row ring launch takes at most this many CTAs (one per SM), never fewer than one per two items.
# Why: V4-Flash's 192 items (6 slots x 32 channel tiles) need 96 CTAs; with one on every SM, 72 SMs run
# a single item and are held (512 threads, every register) until it is done, and the shared expert's
# w1/w3, forked on the side stream after the routing, could start only then: 28.2 us into the H200's
# MoE sublayer, 13.8 us after the routing. With fewer CTAs it starts at the routing's end on the SMs
# left over, while gate-up ends when it did (its two-item SMs set that either way). The same programs
# on the same items: the same bits. Measured (docs/PERFORMANCE.md, 2026-12-06 from 08:46 UTC), p50 ms
# at 1 row against a CTA per SM, 3 rounds: one H200, 30 layers: 96 CTAs -0.77 %, 104 -0.82 %, 112
# -0.90 %, 120 -0.98 % (the MoE sublayer 61.5 -> 59.6 us at 112); H100s, 16 layers, three calls: 96
# -1.08 / -0.61 / -0.78 %, 104 -0.85 / -1.05 %, 112 -1.37 / -0.90 / -1.25 %, 120 -0.59 / -0.90 %.
# None: a CTA per SM.
RING_ONE_ROW_SMS: int | None = 112
# The spread gate-up (SPREAD_ROWS) with the ring's slots too (moe_gate_up_lut_spread_ring: 96
# registers a thread against 124, 176 KB of shared memory at D = 4096). Measured on one H200
# (docs/PERFORMANCE.md, twenty-third measurement): the experts call alone at 1 / 2 rows 47.3 / 81.5
# us against 48.2 / 83.3 with the weights in registers; the 30-layer step A/B at 2 rows 5.691 / 5.701
# ms against 5.760 / 5.774 (-1.2 %). At 1 row the spread gate-up with the slots against whole items
# in the ring (the 1-row default): 4.560 / 4.570 ms against 4.551 / 4.531, so SPREAD_ROWS stays
# (2,). A device that cannot give a CTA 176 KB keeps the registers. (The routed experts of 1-2 rows
# in one launch, this schedule followed by down's in the same CTAs, were 9-17 % slower in the step
# at 1 row and not kept: the code is at bce6479.)
SPREAD_RING = True
# The ring gate-up (ring_rows) decodes the groups of x's even 128-blocks by the table and those of
# the odd ones in registers (moe_gate_up_lut_ring_mix; the .cu's decode_f16: prmt on an 8-byte table
# of fp16 high bytes, fp16 MMAs, x's odd blocks staged in fp16 as their e4m3 codes, their scales
# joining the groups'). The same products and the same bits (GPU-tested). The table's lookups load
# the LSU pipe, the register decode the ALU pipe; the ring's weights also pass through the LSU pipe,
# which ncu found the busiest there. Measured on one H200 (docs/PERFORMANCE.md, twenty-fourth
# measurement): the ring gate-up alone 4-6 % faster at 1, 16 and 64 rows; the 30-layer step A/B
# -0.5 % at 1 row, -1.2 % at 8, -2.0 to -2.3 % at 16-64 (with it the ring at 4 rows was no faster:
# RING_MIN_ROWS stays 8). The mixed decode in every kernel was no faster in the step (down and the
# register ring lost 1-7 %; the code at f48fdb0), all groups in registers 4-16 % slower per experts
# call (at 406b595). False: the table alone.
RING_MIX = True
# The same mixed decode in the spread gate-up with the ring's slots (SPREAD_ROWS, SPREAD_RING;
# moe_gate_up_lut_spread_ring_mix: 106 registers a thread against 96, 177 KB of shared memory at
# D = 4096); its GPU test gives the table's bits. On one H200 (docs/PERFORMANCE.md, twenty-fifth
# measurement), the 30-layer step at 2 rows, p50 ms A/B/A/B: 5.647 / 5.643 against 5.696 / 5.713
# without it (-1.0 %), though the experts call alone took 40.5 us against 39.9. At 1 row, with the
# spread taken there too (SPREAD_ROWS = (1, 2)), 4.529 / 4.510 against the default's 4.458 / 4.477:
# SPREAD_ROWS stays (2,). Again on 2026-12-06 (one H200, 30 layers, 2 rounds): +0.88 % at 1 row,
# though its gate-up ends 5.3 us sooner; on two H100s (16 layers) it had won 0.4-0.7 %.
SPREAD_RING_MIX = True
# Every gate-up launch, whatever its rows, takes moe_gate_up_gm: the group-major kernel (the .cu's
# gate_up_gm), whose weights come back from the ring's slots by ldmatrix so that an MMA's k16 is one
# MXFP4 group and its 8 columns 8 pairs: a pass streams and decodes an expert's rows once for up to
# GM_PAIRS of its pairs, against PAIRS_PER_PASS in the kernels above (each further 2 pairs a pass again,
# at 64 rows 1.43 passes per expert read under the synthetic gates' routing). Not the pair-major kernels'
# order of sums, so not their bits (every launch or none: a row's bits alone and in a batch must agree).
# One CTA of GM_WARPS warps per SM; a device that cannot give it gm_shared_bytes keeps the kernels above.
# Measured on one H100, 16 layers, the step against the pair-major kernels, 3 rounds (docs/PERFORMANCE.md,
# 2026-12-07 from 07:53): -0.25 (items) / +0.18 / -3.49 / -2.22 / -1.09 / -6.09 / -14.17 % at 1 / 2 / 4 / 8
# / 16 / 32 / 64 rows, -18.21 % at 64 rows under the skewed routing; the gate-up launch alone 24.2 against
# 27.3 us at 1 row (the spread schedule), 637 against 800 at 64. (Its first layout lost 5-22 %: see gm_unit.)
# With the mixed decode (RING_MIX's, the odd blocks on fp16 MMAs) it measured 0-0.7 % slower at every row
# count: removed (the code at d0340fc).
GATE_UP_GM = True
GM_WARPS, GM_PAIRS, GM_DEPTH, GM_PAD = 16, 8, 3, 64  # the .cu's kGmWarps, kGmPairs, kGmDepth, kGmPad
GM_DOWN_DEPTH = 4  # the .cu's kGmDownDepth: moe_down_gm's ring slots a warp
# Group-major launches of these row counts (<= GM_PAIRS: every row of x staged once) take
# moe_gate_up_gm_spread, the warps' (slot, 8 channels) tasks dealt out evenly over the CTAs; other row
# counts take items of GM_WARPS x 8 channels (at 1 row 96 on 132 SMs, which leaves SMs to the shared
# expert's side stream). The same per-warp work: the same bits. Measured (above): at 1 row items
# -0.25 %, the spread +0.59 %; at 2 / 4 / 8 rows the spread +0.18 / -3.49 / -2.22 %, items +3.38 / -1.72 /
# -0.85 %. The spread on 104-120 CTAs (SMs left to the shared expert) lost 0.1-1.5 % at 1-2 rows (item 7).
GM_SPREAD_ROWS = (2, 3, 4, 5, 6, 7, 8)
# Group-major launches of these row counts (<= GM_FEW_ROWS_MAX) take moe_gate_up_gm_few instead: one CTA of
# GM_FEW_WARPS warps per SM, GM_FEW_WARPS / 2 warp tasks at a time dealt out evenly, each task's two K halves on
# a pair of warps (the .cu's run_gm, kPairs). Every group-major gate-up sums a task's K halves apart and adds
# them (half 0 + half 1), so the same bits whichever kernel. Why: at 1 row a launch has about one task a warp
# and a warp's task is a chain of K / 256 steps; here the chains are half as long and the tasks spread over 128
# SMs, not 96. Measured on one H100, 16 layers, 3 rounds (docs/PERFORMANCE.md, 2026-12-07 from 15:13, two
# calls): the step -1.19 / -0.86 % at 1 row, +2.85 / +2.57 % at 2 rows; the launch alone 25.6 against 28.5 us at
# 1 row, 49.0 against 43.6 at 2 (ncu at 1 row: the same 0.37-0.39 instructions issued a cycle per scheduler as
# the 16-warp items, now with 6 warps each; the warps wait on their weights and scale bytes): 1 row only.
GM_FEW_ROWS = (1,)
GM_FEW_WARPS, GM_FEW_ROWS_MAX = 24, 2  # the .cu's kGmFewWarps, kGmFewRows
# Every down launch takes moe_down_gm: the group-major body for w2 (items of GM_WARPS x 16 rows, a pass
# for up to GM_PAIRS pairs, the combine per 256-row tile), its weights through the ring's slots (cp.async,
# more bytes in flight than down's register stream, whose loads its warps wait on at 16-64 rows: ncu,
# docs/PERFORMANCE.md 2026-12-07 from 07:53, item 8). Not the pair-major kernels' order of sums (every
# launch or none); a device that cannot give it gm_shared_bytes(I, GM_DOWN_DEPTH) keeps moe_down_lut / _lut4.
# Measured on one H100, 16 layers, the step against the pair-major down (down4 from 8 rows), 3 rounds
# (docs/PERFORMANCE.md, 2026-12-07 from 10:16): -0.65 / -1.65 / -0.53 / -1.03 / -2.39 / -3.60 / -5.58 % at
# 1 / 2 / 4 / 8 / 16 / 32 / 64 rows, -6.90 % at 64 rows under the skewed routing; the down launch alone
# 17.9 against 21.0 us at 1 row, 372 against 430 at 64. Its ring has GM_DOWN_DEPTH slots a warp (4 where
# gate-up's 3: I = 2048 leaves the room; 224.5 KB), measured against 3 (the same bits): -0.91 % at 1 row,
# -0.48 to +0.15 % at 2-64 rows (item 5 of that section).
DOWN_GM = True
# moe_down_gm_early instead of moe_down_gm (DOWN_GM's launches): a CTA's first item's routing (nslot, then the slot's
# expert, start and count, then its table entry) read before the PDL wait, as the pair-major down does, so that the
# chain overlaps the activation quantization; the same work, so the same bits (GPU-tested). Why: ncu at 1 row
# (docs/PERFORMANCE.md, 2026-12-07 from 12:20, item 2) put 27 % of down's stall samples in its prologue, 8.9 % on
# the routing's loads. Measured (2026-12-07 from 17:31, two calls on one H100, 16 layers, the step against off):
# -0.61 / -0.91 % at 1 row, -0.31 / -0.88 % at 2, 0.00 / -0.41 % at 4, within +-0.3 % at 8-64 rows; alone (no PDL)
# the two kernels take the same time. On at every row count (a row's bits do not depend on it either way).
DOWN_GM_EARLY = True


@functools.cache
def _have_nvcc() -> bool:  # looked up once: `supported` runs on every eager experts call
    return find_nvcc() is not None


def supported(device: torch.device, dtype: torch.dtype, D: int, I: int) -> bool:
    """Whether mode "lut" can run: a CUDA device, nvcc to build the kernels, bf16 activations,
    D and I multiples of 512 (a K half of whole 128-byte steps)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and D % 512 == 0 and I % 512 == 0 and _have_nvcc()


def shared_bytes(K: int, halves: int = 1, slot_warps: int = 0, mix: bool = False, four: bool = False) -> int:
    """Dynamic shared memory of a launch over K: the table (mix: and x's block exponents), the .cu's
    Layout(K) (2 rows of x in 16-bit values) of each CTA half, then the RING_DEPTH 2 KB slots of
    slot_warps warps. four (moe_down_lut4): 4 rows of x, then the K half 0 sums of 2 pair sets (4
    floats each) of the CTA's THREADS threads."""
    if four:
        return LUT_BYTES + 8 * K + 2 * 16 * THREADS
    return LUT_BYTES + (EXP_BYTES if mix else 0) + halves * 4 * K + slot_warps * RING_DEPTH * 2048


def gm_shared_bytes(K: int, depth: int = GM_DEPTH) -> int:
    """Dynamic shared memory of a group-major launch over K: the table, GM_PAIRS rows of x (2 K + GM_PAD bytes
    each), GM_WARPS warps' `depth` 2 KB slots (224.5 KB at K = 4096, 192.5 KB at K = 2048)."""
    return LUT_BYTES + GM_PAIRS * (2 * K + GM_PAD) + GM_WARPS * depth * 2048


def gm_few_shared_bytes(K: int) -> int:
    """Dynamic shared memory of moe_gate_up_gm_few over K: the table, GM_FEW_ROWS_MAX rows of x, GM_FEW_WARPS
    warps' GM_DEPTH 2 KB slots (224.1 KB at K = 4096)."""
    return LUT_BYTES + GM_FEW_ROWS_MAX * (2 * K + GM_PAD) + GM_FEW_WARPS * GM_DEPTH * 2048


def gate_up_pairs_per_pass(device: torch.device | None = None, D: int = 4096) -> int:
    """The pairs a pass of a gate-up launch over D takes: GM_PAIRS with GATE_UP_GM on a CUDA device that
    gives the group-major kernel its shared memory (as gate_up decides; any other device: as if it did),
    else PAIRS_PER_PASS."""
    return GM_PAIRS if GATE_UP_GM and _gm_room(device, D) else PAIRS_PER_PASS


def _gm_room(device: torch.device | None, K: int, depth: int = GM_DEPTH) -> bool:
    """Whether `device` gives a group-major launch over K with `depth` ring slots a warp its shared memory, for
    counting passes (None or a device that is not CUDA: as if it did)."""
    return device is None or device.type != "cuda" or _ring_fits(device.index, gm_shared_bytes(K, depth))


def _ring_kernel(plain, mixed, want_mix: bool, index: int, K: int, halves: int, slot_warps: int):
    """(kernel, dynamic shared memory) of a launch whose weights pass through ring slots: `mixed`
    where want_mix and its x block exponents fit (K / 128 <= 64 blocks, 1 KB more shared memory on
    device `index`), else `plain`."""
    mix = want_mix and K <= 8192 and _ring_fits(index, shared_bytes(K, halves, slot_warps, True))
    return (mixed if mix else plain), shared_bytes(K, halves, slot_warps, mix)


def spread_rows(pairs: torch.Tensor, topk: int) -> int:
    """M when a gate-up launch over these pairs (M rows) takes moe_gate_up_lut_spread, else 0."""
    M = pairs.numel() // topk
    assert all(0 < m <= 2 for m in SPREAD_ROWS), SPREAD_ROWS  # the .cu stages at most 2 rows of x
    return M if M in SPREAD_ROWS else 0


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(items: int, device: torch.device, per_sm: int = CTAS_PER_SM) -> tuple[int, int, int]:
    return (max(1, min(items, per_sm * _sms(device.index))), 1, 1)


def down_pairs_per_pass(M: int, device: torch.device | None = None, I: int = 2048) -> int:
    """The pairs a pass of a down launch of M rows over I takes: GM_PAIRS with DOWN_GM on a CUDA device
    that gives moe_down_gm its shared memory (as down decides; any other device: as if it did), else 4
    (moe_down_lut4) from DOWN4_MIN_ROWS rows on, else PAIRS_PER_PASS."""
    if DOWN_GM and _gm_room(device, I, GM_DOWN_DEPTH):
        return GM_PAIRS
    return 4 if _down4(M) else PAIRS_PER_PASS


def _down4(M: int) -> bool:
    """Whether a pair-major down launch of M rows takes moe_down_lut4."""
    return DOWN4_MIN_ROWS is not None and M >= DOWN4_MIN_ROWS


def ring_rows(M: int) -> bool:
    """Whether a gate-up launch of M rows (not taken by the spread gate-up) takes the ring kernel."""
    return RING_MIN_ROWS is not None and (M == 1 or M >= RING_MIN_ROWS)


@functools.cache
def _ring_fits(index: int, nbytes: int) -> bool:
    """Whether device `index` gives a CTA nbytes of shared memory (a torch without the property:
    Hopper's 227 KB)."""
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return nbytes <= (optin if optin is not None else (227 << 10 if props.major >= 9 else 0))


def _ring_grid(items: int, device: torch.device, rows: int) -> tuple[int, int, int]:
    """The ring launch's CTAs: one per SM at most, each running two items at a time (the halves);
    at 1 row at most RING_ONE_ROW_SMS of them, but enough for every item to have a half."""
    grid = _grid(items, device, 1)
    if rows == 1 and RING_ONE_ROW_SMS is not None:
        return (min(grid[0], max(RING_ONE_ROW_SMS, -(-items // 2))), 1, 1)
    return grid


def gate_up(xq, addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, D, I, strides, limit, topk,
            round_bf16, sparse) -> None:
    """act[p] = rnd(r_p * silu(min(rnd(w1 . xq[p // topk]), limit)) * clamp(rnd(w3 . xq), +-limit));
    strides: the table's (w13 row, w13 scale row) strides."""
    assert xq.dtype == act.dtype == torch.bfloat16 and xq.stride(1) == 1 and act.stride(1) == 1
    slots, spread, rows = min(pairs.numel(), addr.shape[0]), spread_rows(pairs, topk), pairs.numel() // topk
    args = (xq, xq.stride(0), addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, act.stride(0),
            D, I, strides[0], strides[1], float(limit), int(round_bf16), topk, int(sparse))
    ring_warps = 2 * THREADS // 32  # the ring kernel: two halves, 16 warps' slots
    smem = gm_shared_bytes(D)
    if GATE_UP_GM and _ring_fits(xq.device.index, smem):
        few = gm_few_shared_bytes(D)
        if rows in GM_FEW_ROWS and _ring_fits(xq.device.index, few):  # task halves on warp pairs, one CTA per SM
            assert rows <= GM_FEW_ROWS_MAX, rows  # (the .cu stages every row of x: at most GM_FEW_ROWS_MAX)
            tasks = slots * (I // 8)
            _GATE_UP_GM_FEW.launch(_grid(-(-tasks // (GM_FEW_WARPS // 2)), xq.device, 1), (32 * GM_FEW_WARPS, 1, 1),
                                   few, None, *args, rows, slots, pdl=pdl_enabled())
        elif rows in GM_SPREAD_ROWS:  # warp tasks (slot, 8 channels), one CTA per SM
            assert rows <= GM_PAIRS, rows  # (the .cu stages every row of x: at most GM_PAIRS)
            _GATE_UP_GM_SPREAD.launch(_grid(slots * (I // 8), xq.device, 1), (32 * GM_WARPS, 1, 1), smem, None,
                                      *args, rows, pdl=pdl_enabled())
        else:  # items (slot, GM_WARPS x 8 channels)
            _GATE_UP_GM.launch(_grid(slots * (I // (8 * GM_WARPS)), xq.device, 1), (32 * GM_WARPS, 1, 1), smem,
                               None, *args, pdl=pdl_enabled())
    elif spread:  # warp tasks (slot, 8 channels), one CTA per SM
        if SPREAD_RING and _ring_fits(xq.device.index, shared_bytes(D, 1, SPREAD_WARPS)):
            kernel, smem = _ring_kernel(_GATE_UP_SPREAD_RING, _GATE_UP_SPREAD_RING_MIX, SPREAD_RING_MIX,
                                        xq.device.index, D, 1, SPREAD_WARPS)
        else:
            kernel, smem = _GATE_UP_SPREAD, shared_bytes(D)
        kernel.launch(_grid(slots * (I // 8), xq.device, 1), (32 * SPREAD_WARPS, 1, 1), smem, None, *args, spread,
                      pdl=pdl_enabled())
    elif ring_rows(rows) and _ring_fits(xq.device.index, shared_bytes(D, 2, ring_warps)):
        # items (slot, channel tile), two at a time per CTA
        kernel, smem = _ring_kernel(_GATE_UP_RING, _GATE_UP_RING_MIX, RING_MIX, xq.device.index, D, 2, ring_warps)
        kernel.launch(_ring_grid(slots * (I // ITEM_CHANNELS), xq.device, rows), (2 * THREADS, 1, 1), smem, None,
                      *args, pdl=pdl_enabled())
    else:  # items (slot, channel tile)
        _GATE_UP.launch(_grid(slots * (I // ITEM_CHANNELS), xq.device), (THREADS, 1, 1), shared_bytes(D), None, *args,
                        pdl=pdl_enabled())


def down(aq, addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, counters, D, I, strides, topk, sparse,
         combine, shared=None) -> None:
    """y[p] = rnd(w2 . aq[p]); with combine out[m] = sum over slots j of y[m * topk + j] (fp32,
    slot order) by the last CTA to finish each (row, ITEM_ROWS tile), counters [M, D / ITEM_ROWS] int32 at
    zero (left at zero). shared (bf16 [M, D]): out is bf16 and receives rnd(that sum + shared).
    strides: the table's (w2 row, w2 scale row) strides."""
    assert aq.dtype == y.dtype == torch.bfloat16 and aq.stride(1) == 1 and y.stride(1) == 1
    if shared is not None:
        assert combine and shared.dtype == out.dtype == torch.bfloat16 and shared.stride(1) == 1, (shared.dtype,
                                                                                                    out.dtype)
    else:
        assert out.dtype == torch.float32, out.dtype
    slots = min(pairs.numel(), addr.shape[0])
    args = (aq, aq.stride(0), addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, y.stride(0), out, out.stride(0),
            counters, D, I, strides[0], strides[1], topk, int(sparse), int(combine),
            0 if shared is None else shared, 0 if shared is None else shared.stride(0))
    smem = gm_shared_bytes(I, GM_DOWN_DEPTH)
    if DOWN_GM and _ring_fits(aq.device.index, smem):  # items (slot, GM_WARPS x 16 rows)
        kernel = _DOWN_GM_EARLY if DOWN_GM_EARLY else _DOWN_GM
        kernel.launch(_grid(slots * (D // (16 * GM_WARPS)), aq.device, 1), (32 * GM_WARPS, 1, 1), smem, None, *args,
                      pdl=pdl_enabled())
        return
    four = _down4(pairs.numel() // topk)
    (_DOWN4 if four else _DOWN).launch(_grid(slots * (D // ITEM_ROWS), aq.device), (THREADS, 1, 1),  # (slot, row tile)
                                       shared_bytes(I, four=four), None, *args, pdl=pdl_enabled())
