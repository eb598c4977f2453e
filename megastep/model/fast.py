"""Batched, static-shape decode step of DeepSeek-V4: the fast path.

One step advances B rows, each a sequence at its own position, addressed by a slot id in fixed
state pools. Every shape is static and nothing reads device values on the host, so a step can be
captured in a CUDA graph per batch bucket (runtime/step.py). Data-dependent control flow of the
reference becomes masking: window slots and compressed entries past a row's position are masked
out, a compressor emits an entry only for the rows whose window closes (the others write nothing,
or to a discard row in the torch twin), the indexer takes a fixed top-k and masks what is not
visible.

Weights stay in their checkpoint formats: FP8 e4m3 + E8M0 block scales, MXFP4 experts stacked
per layer and reached through a per-layer address table (`kernels.moe.ExpertTable`: in device
memory, or for the experts a placement marks cold, in page-locked host memory), BF16/F32 for the
rest. Projections that read the same input are concatenated at load and run as one launch. The heavy
linears run in Triton kernels on CUDA (`kernels/`), and in their torch `*_ref` twins elsewhere,
so this file's logic is tested on CPU against the reference decode.

Numerics follow the reference decode (model/reference.py) rounding point by rounding point, with
the quantization simulations on: the two differ by fp32 summation order only.

Beside this file: the MoE sublayer's methods (model/moe_sublayer.py, a mixin of FastDecoder), the
linears (model/linears.py) and the state pools (model/state_pools.py).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from megastep.config import CSA_RATIO, ModelConfig
from megastep.kernels import attention as _attn
from megastep.kernels import common as _common
from megastep.kernels import compressor as _comp
from megastep.kernels import dense as _dense
from megastep.kernels import indexer as _idx
from megastep.kernels import linear_fp8 as _lin
from megastep.kernels import mhc as _mhc
from megastep.kernels import moe as _moe
from megastep.kernels import moe_lut as _moe_lut
from megastep.kernels import rope_norm as _rn
from megastep.kernels import route_cuda as _route_cuda
from megastep.model import ops
from megastep.model.linears import Linear, LinearGroup
from megastep.model.moe_sublayer import MoeSublayer
from megastep.model.state_pools import StatePools
from megastep.runtime.distributed import experts_of
from megastep.runtime.trace import StepTrace, stage

PDL_MAX_ROWS = 4  # FastDecoder(pdl=None): programmatic dependent launch for steps up to this many rows
# The same with several ranks (expert parallelism). Measured on 2 x H200, all 43 V4-Flash layers, the
# peer-to-peer combine, p50 ms A/B (docs/PERFORMANCE.md, eighteenth measurement): 1 row 6.755 / 6.735
# with PDL against 7.547 / 7.529 without, 6 rows 11.790 / 11.792 against 12.512 / 12.610; twentieth
# measurement: 8 rows 13.403 / 13.344 against 13.900 / 13.910, 16 rows 18.864 / 18.840 against 19.377 /
# 19.357 (on one GPU PDL is slower from 16 rows on). More rows are not measured on the ranks. The
# all-reduce combine was not measured with PDL: it stays without.
PDL_MAX_ROWS_EP = 16
# FastDecoder(router=None, shared_after_router=None, shared_w2=None) on one GPU: by a step's rows
# (up to the first entry's count), which launches route ("triton": router.py's; "cuda": the gate
# GEMV, then route_cuda's), whether the shared expert's side stream forks after the router (else
# before it) and where its w2 output meets the routed sum (FastDecoder's shared_w2); with several
# ranks MOE_PLAN_ABOVE, the order measured there. Every choice gives the same bits. Measured on one
# H200, 30 V4-Flash layers, p50 ms (docs/PERFORMANCE.md, twelfth and thirteenth measurements):
# - the fork, with the shared w2 "residual": 1 row, the late fork 5.33-5.36 against 5.39-5.43
#   (Triton routing); 4 rows, late 8.66-8.72 against 9.40 (CUDA routing); 16 rows, the early fork
#   19.88 against 20.17 (CUDA); 64 rows, early (Triton); 1 row again on 2026-12-06 (today's kernels,
#   2 rounds): early +1.0 %, and its w1/w3 starts no sooner: the ring gate-up's CTAs, placed under PDL
#   while the routing runs, hold every SM until its one-item SMs are done;
# - the shared w2 (this plan with Triton routing at 1 and 64 rows): "mhc" against "residual" 5.15 /
#   5.33 at 1 row, 8.42 / 8.59 at 4, 19.48-19.58 / 19.79 at 16, but 56.17 / 55.06-55.12 at 64;
# - the routing, CUDA (its launch built for the expert count, redux argmax) against Triton: 1 row
#   5.06-5.09 / 5.15-5.16, 16 rows 19.62 / 19.92-19.93, 64 rows 55.00 / 55.05-55.11 (A/B/A; at 64
#   rows 384 pairs are too many for its grouping: moe_route's launches group them).
# Above 64 rows (not measured): MOE_PLAN_ABOVE.
MOE_PLAN = ((1, "cuda", True, "mhc"), (4, "cuda", True, "mhc"), (16, "cuda", False, "mhc"),
            (64, "cuda", False, "residual"))
MOE_PLAN_ABOVE = ("triton", False, "residual")
# With several ranks and the peer-to-peer combine (the whole shared expert beside the routed experts,
# so the shared w2 entry does not apply): 1 row takes the CUDA routing and the late fork, measured
# on 2 x H200, all 43 layers, p50 ms A/B/A/B: 7.497 / 7.500 against MOE_PLAN_ABOVE's 8.274 / 8.286
# (docs/PERFORMANCE.md, sixteenth measurement). Twentieth measurement, the same A/B/A/B: 6 rows (PDL
# on) 11.644 / 11.748 against 11.616 / 11.617, so MOE_PLAN_ABOVE; 8 and 16 rows (PDL off then) 13.417 /
# 13.423 against 13.900 / 13.910 and 18.766 / 18.767 against 19.377 / 19.357. 2-5 rows and the
# all-reduce combine are not measured: MOE_PLAN_ABOVE.
MOE_PLAN_EP = ((1, "cuda", True, "residual"), (6, *MOE_PLAN_ABOVE), (16, "cuda", True, "residual"))
# For steps of at most this many rows, every mHC finish's Sinkhorn (the stream update's post and
# comb) runs in a launch of its own on the side stream, forked after the collapse launch (it reads
# only the mixes' partials, but waits for the collapse too): the sublayer's input x waits for the
# collapse only, and the main stream joins the side stream before the next stream update reads post
# and comb. The same kernel programs: the same bits. In ncu at one row the finish
# with its Sinkhorn program takes 5.6-6.2 us, the collapse alone 4.6. 30 V4-Flash layers on one
# H200, p50 ms A/B (docs/PERFORMANCE.md, eighteenth measurement), beside against in the finish:
# 1 row 4.695 / 4.691 against 4.723 / 4.724, 2 rows 5.875 / 5.861 against 5.867 / 5.865, 4 rows
# 7.920 / 7.921 against 7.927 / 7.929, 16 rows 18.122 / 18.092 against 18.376 / 18.343, but 64 rows
# 54.46 / 54.50 against 52.11 / 51.88 (there it delays the shared expert's early fork, a reading).
# One GPU without the CPU sidecar only: the ranks and the sidecar use the side stream otherwise and
# were not measured with it.
MHC_SINKHORN_BESIDE_ROWS = 16
# Steps of (lo, hi) rows, lo..hi inclusive, put the Sinkhorn beside on a third stream of its own
# instead of the side stream, where the compressors' bf16 projection queues behind it (it closed
# 12.1 us of a CSA layer in the eighteenth measurement's 1-row timeline). The same kernel programs:
# the same bits. 30 V4-Flash layers on one H200, p50 ms A/B/A/B against the side stream
# (docs/PERFORMANCE.md, nineteenth measurement): 2 rows 5.729 / 5.714 against 5.831 / 5.784, 4 rows
# 7.744 / 7.717 against 7.779 / 7.777; but 1 row 4.751 / 4.723 against 4.643 / 4.610 (the x group's
# launch then waits: its stretch grew 0.3 -> 5.3 us) and 16 rows 18.234 / 18.202 against 17.962 /
# 17.927.
MHC_SINKHORN_OWN_STREAM_ROWS = (2, 4)
# For steps of at most this many rows, a CSA layer's indexer runs beside the attention's q: the
# qr group's launch is split in two, the indexer's wq_b first, then (on the main stream) the
# attention's wq_b and its q norm + RoPE while the indexer's q transform, scores and top-k run on a
# stream of their own (the scores wait for the indexer's compressor on the side stream, not for
# the whole side stream). Before, the indexer's four launches (~13 us of a 1-row CSA layer in the
# twenty-fourth measurement's timeline) all waited for the whole qr group and ran between it and
# attention. Both halves take the qr group's launch configuration (LinearGroup.part): the same
# bits. One GPU without the CPU sidecar only. 30 V4-Flash layers on one H200, p50 ms A/B/A/B
# against the qr group in one launch (docs/PERFORMANCE.md, twenty-fifth measurement): 1 row 4.476 /
# 4.469 against 4.476 / 4.474, 2 rows 5.623 / 5.634 against 5.689 / 5.683, 4 rows 7.591 / 7.571
# against 7.621 / 7.618, 8-32 rows within 0.1 % either way, 64 rows 47.61 / 47.59 against 47.70 /
# 47.80. At 1 row the indexer leaves the path (its top-k ends 0.2 us before q) but the q path
# grows about as much: the attention's wq_b waits for the indexer's launch (128 programs, 7 us for 8 MB)
# and then streams beside the compressors' projection and the indexer's launches (19.8 us for 34 MB).
INDEXER_BESIDE_ROWS = 64
# FastDecoder(attn_split=None) with several ranks: the attention's heads split over the ranks (tensor
# parallelism, the 1-GPU bits). Measured on 2 x H200, all 43 V4-Flash layers, the p2p combine, p50 ms
# A/B against every head on every rank (docs/PERFORMANCE.md, twenty-sixth measurement): 1 row 6.141 /
# 6.256 against 6.533 / 6.606, 6 rows 11.120 / 10.983 against 11.259 / 11.310, 64 rows 45.85 / 45.92
# against 46.07 / 46.06, but 16 rows 18.279 / 18.288 against 17.899 / 17.871. It sets what each rank
# loads, so it holds for every batch; on for the 1-row and the 6-row block's gains.
ATTN_SPLIT = True
# FastDecoder(vocab_split=None) with several ranks: the lm head's vocabulary split over the ranks (the
# 1-GPU bits). Off until measured on the ranks (built 2026-12-01 when the 2-GPU machines were withdrawn:
# its GPU tests have not run either).
VOCAB_SPLIT = False
# With several ranks, also take the one-GPU side streams of INDEXER_BESIDE_ROWS and
# MHC_SINKHORN_BESIDE_ROWS (the same bits). Measured once on 2 x H200 with the heads split (twenty-sixth
# measurement): 1 row 6.143, 6 rows 10.987, 16 rows 18.296, 64 rows 45.878 ms, within the split's own
# A/B spread: off.
BESIDE_ON_RANKS = False
# A CSA layer of at most INDEXER_BESIDE_ROWS rows (one GPU): the indexer's work first on its streams.
# On the side stream, the bf16 rows of the indexer's compressor and weights_proj (4.7 MB at V4-Flash
# width) in a launch of their own before the attention compressor's (16.8 MB), so the index keys are
# ready after the first; on the indexer's stream, its q rows (8 MB) beside the attention's wq_b
# instead of before it. Each part takes the whole launch's configuration: the same bits. Why: in the
# 1-row timeline (docs/PERFORMANCE.md, 2026-12-04 late night) wq_b starts only after the indexer's
# q rows (7 us), and the select that the attention waits for ends 10 us after the 21 MB projection
# does; the attention starts 42.9 us into the sublayer against 30.1 in an HCA layer. Measured
# 2026-12-05 (benchmarks/h200_checks.sh `one`, `arms2`; docs/PERFORMANCE.md, twenty-eighth
# measurement): 4 and 16 rows -0.65 %, 2 and 64 -0.33 %, 1 row even (p50 of 3 rounds in one process).
# Pinned after `pins` (one H100, 16 layers, 2026-12-05: its GPU bit tests pass; with the 8-slab plans
# below -0.14 to -0.59 % at 1-64 rows).
INDEXER_FIRST = True
# Steps of at most this many rows make the q norm in the x group's launch (linear_fp8(norm_tail=): the
# last program to write a row tile's wq_a columns norms them) instead of a launch of its own between
# wq_a and wq_b, which took ~2.2 us of the 1-row chain per attention sublayer (twenty-eighth measurement).
# The same bits: rms_norm's sum of squares is exact, whatever reads the row. 0: never. Thirtieth
# measurement, item 3 (one H100, 16 layers, p50 of 3 rounds against 0): 1 row -1.09 % (every round below),
# but 2 rows +0.74 %, 4 +0.83 %, 8 +1.37 %, 16 +2.18 %, 64 +3.57 % (one program norms the tile's rows one
# after the other). (The norm in each qr program's prologue instead: +2.8 to +6.2 %, removed; read at 6d1efe0.)
QNORM_TAIL_ROWS = 1
# Steps of at most this many rows (one GPU) take wo_b's split-K partials unsummed (linear_fp8_splits) and
# let the next mixes launch sum them in split order and round them (mhc_post_pre's y [S, B, D]): the same
# bits, and wo_b's launch ends without its arrival count and its last programs' loads of the partials,
# a chain of round trips at the end of every attention sublayer. 0: never. Built 2026-12-08 without a
# device, not measured: off.
WO_B_PARTS_ROWS = 0
# Steps of at most this many rows (one GPU, the shared expert's output added by the next mHC launch: MOE_PLAN's
# "mhc") take the routed experts' per-slot outputs unsummed (moe_experts_table(return_pairs=True)) and let the
# next mixes launch sum them in slot order and add the shared expert's output (mhc_post_pre's y [k, B, D]): the
# same bits, and down's launch ends without its arrival counts and the last CTAs' sums, the end of every MoE
# sublayer. 0: never. Built 2026-12-08 without a device, not measured: off.
MOE_PAIRS_ROWS = 0


def _rows_unit(y: torch.Tensor) -> torch.Tensor:
    """A sublayer's output as the mHC launches take it: channels contiguous; parts ([S, B, D], also a
    transposed view of the experts' pairs) as they are."""
    return y if y.dim() == 3 else y.contiguous()


def _wo_b_partials(u: torch.Tensor, wo_b: Linear, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """wo_b's split-K partials of u, unsummed ([S, B, N] fp32), in the splits of the whole weight's launch
    (K its input width; a rank's wo_b holds a column block of it): summed in order and rounded, they give
    that launch's bits (WO_B_PARTS_ROWS, attn_split)."""
    full = _lin.pick_config(u.shape[0], wo_b.w.shape[0], K)
    return _lin.linear_fp8_splits(u, wo_b.w, wo_b.scale, full, _lin.split_cols(K, full), out=out)


def _rows_of(lin: Linear, lo: int, hi: int) -> Linear:
    """Output rows [lo, hi) of an FP8 linear (whole scale blocks), as a weight of their own."""
    b = lin.block
    assert lo % b == 0 and hi % b == 0, (lo, hi, b)
    return Linear(lin.w[lo:hi].contiguous(), lin.scale[lo // b:hi // b].contiguous(), b, lin.act_quant)


def _cols_of(lin: Linear, lo: int, hi: int) -> Linear:
    """Input columns [lo, hi) of an FP8 linear (whole scale blocks), as a weight of their own."""
    b = lin.block
    assert lo % b == 0 and hi % b == 0, (lo, hi, b)
    return Linear(lin.w[:, lo:hi].contiguous(), lin.scale[:, lo // b:hi // b].contiguous(), b, lin.act_quant)


class FastDecoder(MoeSublayer):
    """`step(tokens, pos, slots) -> fp32 logits [B, vocab]`; advances each row's slot state."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, max_seqs: int, max_ctx: int,
                 device: torch.device | str, dtype: torch.dtype = torch.bfloat16, triton: bool | None = None,
                 consume: bool = False, placement=None, max_block: int = 1, rank: int = 0, world_size: int = 1,
                 group=None, moe_mode: str | None = None, cold_path: str = "gpu", cpu_share: float | None = None,
                 pdl: bool | None = None, overlap: bool | None = None, ep_combine: str | None = None,
                 shared_w2: str | None = None, shared_after_router: bool | None = None, router: str | None = None,
                 attn_split: bool | None = None, vocab_split: bool | None = None):
        """consume=True deletes each layer's tensors from `weights` once the layer is built (experts
        stacked, projections concatenated), so a model filling the device is never held twice.
        placement (runtime.experts.Placement): routed experts it marks cold live in page-locked
        host memory and the experts kernel reads them there through their device-visible
        addresses (zero-copy, issue 4 recipe A); None keeps every expert in device memory.
        max_block: the most rows one sequence may have in a step (a multi-token block, e.g. the
        tokens a speculative round verifies, or a prefill chunk); sizes the window rings.
        rank / world_size / group: expert parallelism (runtime/distributed.py): this process holds
        the routed experts [rank*E/W, (rank+1)*E/W) of every layer (`weights` needs no others) and
        everything else; each MoE call computes its experts' pair outputs, combines them with the
        other ranks bit-exactly and sums them in slot order, so every rank gets the 1-rank logits
        bit for bit. Every rank must make the same step calls.
        ep_combine: how the pairs travel. "p2p": each rank writes its pairs into symmetric memory
        and one kernel waits for the others' arrival flags and reads every pair from its owner over
        NVLink (kernels/pair_combine.py; CUDA, Triton kernels). "allreduce": an integer all-reduce
        of zero-padded pair buffers through the process group (any backend). None: p2p where
        it can run, else allreduce.
        attn_split: with several ranks, split the attention's heads over them (tensor parallelism):
        rank r keeps its H/W heads' rows of wq_b, their sinks, its o_groups/W groups of wo_a and
        the matching K/W columns of wo_b, whose split-K partials every rank gathers over NVLink and
        sums in split order (kernels/split_combine.py). Each launch takes the full shape's
        configuration, so every rank still gets the 1-GPU logits bit for bit. Needs CUDA devices with
        symmetric memory and heads, o_groups and wo_b's K splits divisible by W. None: ATTN_SPLIT
        where it can run.
        vocab_split: with several ranks, split the lm head's rows (the vocabulary) over them: rank r
        computes logits [r*V/W, (r+1)*V/W) in the full head's launch configuration, and every rank
        gathers every rank's columns over NVLink (kernels/split_combine.py, gather_cols): the 1-GPU
        logits bit for bit, 1/W of the head's bytes per GPU. Needs CUDA devices with symmetric memory,
        a bf16 head and a vocabulary divisible by W. None: VOCAB_SPLIT where it can run.
        moe_mode: the routed-experts kernel mode (kernels.moe.ALL_MODES; None: "lut" where it runs, else
            the Triton kernels' default: docs/PERFORMANCE.md, tenth measurement).
        cold_path: how the placement's cold experts are computed: "gpu" (recipe A: the experts
        kernel reads them in host memory), "cpu" (recipe B: the CPU computes them while the GPU
        runs the hot ones, runtime/sidecar.py) or "hybrid" (each layer's cold experts split
        between the two, the CPU taking about `cpu_share` of their expected bytes; None: the CPU
        path's share of the two paths' bandwidths, measured here by runtime.bandwidth).
        pdl: launch the Triton kernels of a step with programmatic dependent launch
        (kernels.common, pdl_enter): each kernel's CTAs are placed while its predecessor drains
        (the large FP8 linears excepted: common.PLAIN_PLACEMENT_BYTES). It changes no bits. None:
        on for steps of at most PDL_MAX_ROWS rows on one GPU (PDL_MAX_ROWS_EP with several ranks and
        the peer-to-peer combine) without the CPU sidecar, where it was measured faster (30 V4-Flash
        layers, one H200: 6.443 against 6.501 ms at 1 row, 11.82 against 11.88 at 4), off above
        (28.71 against 28.48 ms at 16, 69.8 against 62.1 at 64; with the large linears placed
        plainly still 21.39 against 18.43 at 16 and 60.4 against 51.9 at 64, seventeenth
        measurement).
        overlap: run the independent parts of a layer on a second CUDA stream (a fork and a
        join inside the step's graph): the shared expert's gated half beside the router and the
        routed experts, the compressors' projections and updates beside the q/kv projections, the kv
        store (norm, RoPE, window ring write) beside the q path.
        At small batches these kernels are latency-bound, and side by side their tails overlap
        (measured: 7.24 -> 7.07 ms for 30 V4-Flash layers at batch 1). Every kernel computes the
        same values either way. None: on wherever the Triton kernels run on CUDA.
        shared_w2: where the shared expert's w2 runs and how its output meets the routed experts'
        sum; every choice gives rnd(routed + rnd(w2 . a)), the bits of w2's residual epilogue.
        "residual": on the main stream after the routed experts, their sum as its residual.
        "combine": on the side stream after w1/w3, added by the experts' combine (the main stream
        joins the side stream before the down launch). "mhc": on the side stream after w1/w3,
        added by the next mHC launch (mhc_post* with y2; the main stream joins after the experts'
        launches, before it). Both on one GPU with the fused path (else "residual").
        Measured on one H200 (docs/PERFORMANCE.md, twelfth and thirteenth measurements): "combine"
        saved 0.05 ms per 30-layer step at 1 row with the early fork, less than MOE_PLAN's late
        fork, and cost 0.04-0.07 ms at 4 rows and 1.1 ms at 64; "mhc" saved 0.12-0.2 ms at 1-16
        rows and cost 1.1 ms at 64. None: by the step's rows (MOE_PLAN). Read when a step is
        traced or captured.
        shared_after_router: the side stream forks after the router instead of before it, so the
        shared expert's w1/w3 runs beside the routed experts but not beside the router. The same
        bits. None: by the step's rows (MOE_PLAN).
        router: after the gate GEMV (dense.linear_bf16), the routing, the experts' pair grouping
        and x's quantization in one CUDA C++ launch ("cuda", kernels/route_cuda.py) or in
        router.py's Triton launches ("triton"). The same bits either way. None: by the step's rows
        (MOE_PLAN) where the CUDA launch runs, else "triton". Both are read when a step is traced
        or captured."""
        self.cfg, self.dtype = cfg, dtype
        self.world_size, self.group = world_size, group
        if moe_mode is not None and moe_mode not in _moe.ALL_MODES:
            raise ValueError(f"moe_mode must be one of {sorted(_moe.ALL_MODES)}, got {moe_mode!r}")
        self.pdl = pdl
        if cold_path not in ("gpu", "cpu", "hybrid"):
            raise ValueError(f"cold_path must be gpu, cpu or hybrid, got {cold_path!r}")
        if cpu_share is not None and not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"cpu_share must be in [0, 1], got {cpu_share}")
        self.sidecar = None
        self.owned = experts_of(rank, world_size, cfg.n_routed_experts)  # all of them on one rank
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the one tensors report
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.triton = self.device.type == "cuda" if triton is None else triton
        # the routed experts' mode, fixed for the decoder's life (a row's bits must not depend on
        # its batch): None -> the CUDA "lut" kernels where they run (measured faster at every batch
        # on the H200, docs/PERFORMANCE.md, tenth measurement), else the Triton kernels' default
        lut_ok = self.triton and _moe_lut.supported(self.device, dtype, cfg.hidden_size, cfg.moe_intermediate_size)
        if moe_mode == "lut" and not lut_ok:
            raise ValueError("moe_mode 'lut' needs the Triton path on a CUDA device, nvcc, bf16 and hidden and "
                             "moe intermediate sizes that are multiples of 512")
        self.moe_mode = moe_mode or ("lut" if lut_ok else None)
        if router not in (None, "cuda", "triton"):
            raise ValueError(f"router must be cuda or triton, got {router!r}")
        route_ok = self.triton and _route_cuda.supported(self.device, cfg.n_routed_experts, cfg.hidden_size,
                                                         cfg.num_experts_per_tok)
        if router == "cuda" and not route_ok:
            raise ValueError(f"router 'cuda' needs the Triton path on a CUDA device, nvcc, a multiple of 32 experts up "
                             f"to {_route_cuda.MAX_EXPERTS}, top-k up to {_route_cuda.MAX_TOPK} and a hidden size "
                             "that is a multiple of 128")
        self.router, self.route_cuda_ok = router, route_ok
        on_cuda = self.triton and self.device.type == "cuda"
        if overlap and not on_cuda:
            raise ValueError("overlap needs the Triton kernels on a CUDA device")
        self.side_stream = torch.cuda.Stream(self.device) if (on_cuda if overlap is None else overlap) else None
        # MHC_SINKHORN_OWN_STREAM_ROWS' stream (made here: a graph captures the streams it is given)
        self.hc_stream = torch.cuda.Stream(self.device) if self.side_stream is not None else None
        # INDEXER_BESIDE_ROWS' stream
        self.idx_stream = torch.cuda.Stream(self.device) if self.side_stream is not None else None
        if shared_w2 not in (None, "residual", "combine", "mhc"):
            raise ValueError(f"shared_w2 must be residual, combine or mhc, got {shared_w2!r}")
        self.shared_w2 = shared_w2
        self.shared_after_router = shared_after_router
        if cold_path != "gpu" and (world_size > 1 or not self.triton):
            raise ValueError("cold_path cpu / hybrid needs the Triton experts kernel and one rank")
        if cold_path == "hybrid" and cpu_share is None and placement is not None and placement.n_cold:
            from megastep.runtime.bandwidth import hybrid_cpu_share

            cpu_share = hybrid_cpu_share(self.device)
        self.cpu_share = cpu_share
        if max_ctx > cfg.max_position_embeddings:
            raise ValueError("max_ctx exceeds the model's max_position_embeddings")
        if max_block < 1 or max_block > cfg.sliding_window:
            raise ValueError(f"max_block must be in 1..{cfg.sliding_window}, got {max_block}")
        self.max_ctx = max_ctx
        dev = self.device
        self.rank = rank
        self.split_peer = self._peer_splits(attn_split, max_seqs * max_block, on_cuda)
        self.heads = cfg.num_attention_heads // (world_size if self.split_peer is not None else 1)

        def t(name: str) -> torch.Tensor:
            return weights[name].to(dev)

        def lin(name: str, act_quant: bool = True) -> Linear:
            base = name[: -len(".weight")]
            sc = weights.get(base + ".scale")
            return Linear(t(name), sc.to(dev) if sc is not None else None,
                          cfg.fp8_block if cfg.quantization_config else 0, act_quant)

        def f32(name: str) -> torch.Tensor:
            return weights[name].to(dev, torch.float32)

        self.embed = t("embed.weight")
        self.head = t("head.weight")
        self.vocab_peer = self._peer_cols(vocab_split, max_seqs * max_block, on_cuda)
        if self.vocab_peer is not None:  # this rank's logit columns, in the full head's launch configuration
            V = self.head.shape[0] // world_size
            self.head_config = _dense.pick_config(*self.head.shape)
            self.head = self.head[rank * V:(rank + 1) * V].contiguous()
        self.norm_w = f32("norm.weight")
        self.hc_head = (f32("hc_head_fn"), f32("hc_head_scale"), f32("hc_head_base"))
        self.layers: list[dict] = []
        for L in range(cfg.num_hidden_layers):
            p = f"layers.{L}."
            r = cfg.ratio(L)
            wq_a, wkv, wq_b = lin(p + "attn.wq_a.weight"), lin(p + "attn.wkv.weight"), lin(p + "attn.wq_b.weight")
            lw: dict = {
                "hc_attn": (f32(p + "hc_attn_fn"), f32(p + "hc_attn_scale"), f32(p + "hc_attn_base")),
                "hc_ffn": (f32(p + "hc_ffn_fn"), f32(p + "hc_ffn_scale"), f32(p + "hc_ffn_base")),
                "attn_norm": f32(p + "attn_norm.weight"), "ffn_norm": f32(p + "ffn_norm.weight"),
                "q_norm": f32(p + "attn.q_norm.weight"),
                "kv_norm": f32(p + "attn.kv_norm.weight"), "sink": f32(p + "attn.attn_sink"),
                "wo_a": lin(p + "attn.wo_a.weight", act_quant=False), "wo_b": lin(p + "attn.wo_b.weight"),
                "gate": t(p + "ffn.gate.weight"),
            }
            # shared expert: w1 and w3 rows concatenated (w13) for one gated launch with the SwiGLU
            # in its epilogue; w1 / w3 stay as views of it for the torch twin
            w1, w3, w2 = (lin(p + f"ffn.shared_experts.w{i}.weight") for i in (1, 3, 2))
            if w1.scale is not None and w1.kernel_block and w1.w.shape[0] % w1.block == 0:
                I = w1.w.shape[0]
                w13, s13 = torch.cat([w1.w, w3.w]), torch.cat([w1.scale, w3.scale])
                w1.w, w1.scale, w3.w, w3.scale = w13[:I], s13[:I // w1.block], w13[I:], s13[I // w1.block:]
                lw["shared13"] = (w13, s13)
            lw["shared"] = [w1, w3, w2]
            # the projections of one input run as one launch each (LinearGroup): FP8 wq_a + wkv
            # on x, FP8 wq_b (+ the indexer's wq_b) on qr, BF16 compressor / indexer weights on x
            lw["x_fp8"] = LinearGroup([wq_a, wkv])
            qr_parts, dense_parts = [wq_b], []
            if cfg.is_hash_layer(L):
                lw["tid2eid"] = t(p + "ffn.gate.tid2eid").long()
            else:
                lw["gate_bias"] = f32(p + "ffn.gate.bias")
            if r:
                c = p + "attn.compressor."
                dense_parts += [t(c + "wkv.weight"), t(c + "wgate.weight")]
                lw["comp"] = (f32(c + "ape"), f32(c + "norm.weight"))
            if r == CSA_RATIO:
                c = p + "attn.indexer."
                dense_parts += [t(c + "compressor.wkv.weight"), t(c + "compressor.wgate.weight"), t(c + "weights_proj.weight")]
                lw["idx_comp"] = (f32(c + "compressor.ape"), f32(c + "compressor.norm.weight"))
                qr_parts.append(lin(c + "wq_b.weight"))
            if self.split_peer is not None:  # this rank's heads, and the full launches' configurations
                lw.update(self._head_split(lw))
                qr_parts[0] = _rows_of(wq_b, rank * self.heads * cfg.head_dim, (rank + 1) * self.heads * cfg.head_dim)
            lw["qr_fp8"] = LinearGroup(qr_parts, like_rows=(None if self.split_peer is None
                                                            else sum(p.w.shape[0] for p in [wq_b, *qr_parts[1:]])))
            if dense_parts:
                lw["x_dense"] = (torch.cat(dense_parts), [w.shape[0] for w in dense_parts])
                del dense_parts
            if cfg.fp4_experts:
                st = _moe.stack_experts(weights, f"layers.{L}", cfg.n_routed_experts, ids=self.owned)
                if consume:  # the stack replaces them: placing it then holds two copies of a layer's experts
                    for k in [k for k in weights if k.startswith(p + "ffn.experts.")]:  # at most, not three
                        del weights[k]
                if self.triton:
                    cold = placement.cold(L) if placement is not None else []
                    cpu = self._cpu_experts(L, cold, placement, cold_path, cpu_share)
                    lw["experts"] = self._place_experts(L, st, cold, cpu)
                    lw["cpu_experts"] = bool(cpu)
                else:  # the torch twin reads stacked tensors (of the owned experts)
                    lw["experts_stacked"] = {k: v.to(dev) for k, v in st.items()}
                del st
            else:
                lw["experts_plain"] = [[lin(p + f"ffn.experts.{e}.w{i}.weight") for i in (1, 3, 2)] for e in range(cfg.n_routed_experts)]
            if consume:  # the layer now holds what it needs (fused copies, stacked experts)
                for k in [k for k in weights if k.startswith(p)]:
                    del weights[k]
            del wq_a, wkv, wq_b, qr_parts, w1, w3, w2
            self.layers.append(lw)
        self.inv_freq = {c: ops.rope_inv_freq(cfg, c).to(dev) for c in (False, True)}
        # cos | sin tables for the attention output's inverse RoPE: computed by torch, so the
        # kernel's rotation rounds exactly as the reference's
        self.rope = {c: _rn.rope_table(f, max_ctx + 1) for c, f in self.inv_freq.items()}
        self.pools = StatePools(cfg, max_seqs, max_ctx, dtype, dev, max_block=max_block)
        self.trace: StepTrace | None = None  # attach one to time stages (eager steps only)
        # a list to collect each MoE sublayer's (layer, expert ids [rows, k]) (eager steps only)
        self.route_log: list[tuple[int, torch.Tensor]] | None = None
        self.peer = self._peer_pairs(ep_combine, max_seqs * max_block, on_cuda)

    def _peer_pairs(self, ep_combine: str | None, max_rows: int, on_cuda: bool):
        """The peer-to-peer combine's buffers (runtime.distributed.PeerPairs), or None for the
        all-reduce (one rank, or ep_combine="allreduce")."""
        from megastep.runtime.distributed import PeerPairs

        if ep_combine not in (None, "p2p", "allreduce"):
            raise ValueError(f"ep_combine must be p2p or allreduce, got {ep_combine!r}")
        can = on_cuda and self.cfg.num_hidden_layers >= 2 and PeerPairs.available()
        if ep_combine == "p2p" and not can:
            raise ValueError("ep_combine p2p needs the Triton kernels on CUDA devices, two MoE layers or more "
                             "and a PyTorch with symmetric memory")
        if self.world_size == 1 or ep_combine == "allreduce" or not can:
            return None
        try:
            return PeerPairs(self.cfg.num_hidden_layers, max_rows * self.cfg.num_experts_per_tok,
                             self.cfg.hidden_size, self.dtype, self.device, self.group)
        except (RuntimeError, OSError) as e:  # e.g. GPUs without peer access: every rank fails alike
            if ep_combine == "p2p":
                raise
            warnings.warn(f"peer-to-peer expert combine unavailable ({e}); using the all-reduce", stacklevel=2)
            return None

    def _split_buffers(self, flag: str, asked: bool | None, default: bool, what: str, problems, make, fallback: str):
        """The peer buffers of one split over the ranks, or None. `flag`/`asked`: the constructor's
        argument and its value; refused with the reasons of `problems` ((bad, needs) pairs) when asked
        for, else not taken where it cannot run or `default` is off. Where `make()` fails (e.g. GPUs
        without peer access: every rank fails alike) it is raised when asked for, else warned
        (`fallback`: what runs instead)."""
        if asked is False or self.world_size == 1:
            if asked:
                raise ValueError(f"{flag} splits {what} over several ranks: it needs world_size > 1")
            return None
        why = [m for bad, m in problems if bad]
        if why:
            if asked:
                raise ValueError(f"{flag} needs " + "; ".join(why))
            return None
        if asked is None and not default:
            return None
        try:
            return make()
        except (RuntimeError, OSError) as e:
            if asked:
                raise
            warnings.warn(f"the split of {what} is unavailable ({e}); {fallback}", stacklevel=3)
            return None

    def _peer_splits(self, attn_split: bool | None, max_rows: int, on_cuda: bool):
        """The tensor-parallel attention's combine buffers (runtime.distributed.PeerSplits) when the
        heads are split over the ranks (attn_split), else None."""
        from megastep.runtime.distributed import PeerSplits

        cfg, W = self.cfg, self.world_size
        K = cfg.o_groups * cfg.o_lora_rank  # wo_b's input width
        cols = _lin.split_cols(K, _lin.pick_config(1, cfg.hidden_size, K))
        splits = K // cols if K % cols == 0 else 0  # whole splits only
        problems = [
            (not (on_cuda and PeerSplits.available()), "the Triton kernels on CUDA devices and a PyTorch with symmetric memory"),
            (cfg.num_hidden_layers < 2, "two layers or more"),
            (cfg.num_attention_heads % W or cfg.o_groups % W or not splits or splits % W,
             f"heads, o_groups and wo_b's K splits ({splits} whole ones) divisible by the {W} ranks"),
            (not (cfg.quantization_config and cfg.fp8_block == _lin.BLOCK), "FP8 weights in 128x128 blocks")]
        return self._split_buffers(
            "attn_split", attn_split, ATTN_SPLIT, "the attention's heads", problems,
            lambda: PeerSplits(cfg.num_hidden_layers, splits // W, max_rows, cfg.hidden_size, self.device, self.group),
            "every rank runs every head")

    def _peer_cols(self, vocab_split: bool | None, max_rows: int, on_cuda: bool):
        """The vocabulary split's gather buffers (runtime.distributed.PeerCols), or None."""
        from megastep.runtime.distributed import PeerCols

        W, V = self.world_size, self.cfg.vocab_size
        problems = [
            (not (on_cuda and PeerCols.available()), "the Triton kernels on CUDA devices and a PyTorch with symmetric memory"),
            (self.head.dtype != torch.bfloat16, "a bf16 head"),
            (V % W, f"a vocabulary divisible by the {W} ranks")]
        return self._split_buffers("vocab_split", vocab_split, VOCAB_SPLIT, "the lm head", problems,
                                   lambda: PeerCols(max_rows, V // W, self.device, self.group),
                                   "every rank runs the whole head")

    def _head_split(self, lw: dict) -> dict:
        """This rank's share of a layer's head-split weights: its heads' sinks, its groups' rows of
        wo_a, the matching input columns of wo_b."""
        cfg, r, W = self.cfg, self.rank, self.world_size
        rows = cfg.o_groups // W * cfg.o_lora_rank
        cols = lw["wo_b"].w.shape[1] // W
        return {"sink": lw["sink"][r * self.heads:(r + 1) * self.heads].contiguous(),
                "wo_a": _rows_of(lw["wo_a"], r * rows, (r + 1) * rows),
                "wo_b": _cols_of(lw["wo_b"], r * cols, (r + 1) * cols)}

    # ---- the second stream --------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_side(self, stream: torch.cuda.Stream | None = None, lane: str = "side"):
        """Launch on the side stream (or `stream`, with the workspace lane `lane`), ordered after
        the main stream's work so far, with its own split-reduction workspaces; inline on the
        current stream without overlap."""
        stream = stream or self.side_stream
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), _common.lane(lane):
            yield

    def _join(self, *made_on_side: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """The main (current) stream waits for the side stream (or `stream`); tensors that stream
        allocated are marked as used by the main stream, so the allocator does not hand their memory
        back to it before the main stream's kernels that read them have run."""
        stream = stream or self.side_stream
        if stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(stream)
        for t in made_on_side:
            t.record_stream(main)

    def _joined(self, t: torch.Tensor) -> torch.Tensor:
        """`_join(t)`, then t: a tensor made on the side stream, ready for the main stream."""
        self._join(t)
        return t

    # ---- pieces ---------------------------------------------------------------------------
    def _kernel(self, module, name: str):
        """The Triton kernel on CUDA, its torch `*_ref` twin elsewhere."""
        return getattr(module, name if self.triton else name + "_ref")

    def _dense(self, x: torch.Tensor, w: torch.Tensor, config=None) -> torch.Tensor:
        """A BF16 weight in fp32 math (compressor, gate, weights_proj, head): fp32 out. config: the
        kernel's configuration (default: its own for w's shape)."""
        if self.triton and w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
            return _dense.linear_bf16(x.contiguous(), w, torch.float32, config=config)
        return x.float() @ w.float().T

    def _compress(self, kv, score, pos, passes, L, which: str):
        """Feed each row's compressor projections (kv, score: fp32 [B, W2]) into a compressor and
        emit entries where windows close. `passes`: one slots tensor per pass (see step)."""
        cfg, P = self.cfg, self.pools
        if which == "comp":
            ape, norm_w = self.layers[L]["comp"]
            kvp, scp, ent, r = P.ckv[L], P.csc[L], P.cent[L], cfg.ratio(L)
        else:
            ape, norm_w = self.layers[L]["idx_comp"]
            kvp, scp, ent, r = P.ikv[L], P.isc[L], P.ikeys[L], CSA_RATIO
        # add the position bias, store the row; where the window closes: softmax pooling, norm,
        # RoPE, simulation, entry write and (overlapping compressors) the shift of the closed window
        for slots in passes:
            self._kernel(_comp, "compressor_step")(kv, score, kvp, scp, ent, slots, pos, norm_w, self.inv_freq[True],
                                                   r, r == CSA_RATIO, "index" if which == "idx" else "kv",
                                                   cfg.rms_norm_eps, ape=ape)

    def _indexer(self, q, wl, pos, slots, L, keys_ready: torch.cuda.Event | None = None):
        """q: the indexer's wq_b output [B, H*di]; wl: weights_proj output fp32 [B, H].
        keys_ready: recorded once the indexer's compressor (and wl) are done on the side stream;
        the scores wait for it after the q transform."""
        cfg = self.cfg
        B = q.shape[0]
        q = self._kernel(_rn, "indexer_q")(q.view(B, cfg.index_n_heads, cfg.index_head_dim), self.inv_freq[True], pos)
        if keys_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(keys_ready)
        if self.triton and q.dtype == torch.bfloat16:  # scores read the key pool in place; radix top-k
            return _idx.indexer_topk(q, wl, self.pools.ikeys[L], slots, pos, cfg.index_topk, CSA_RATIO)
        w = wl.to(self.dtype).float() * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        n = self.pools.ikeys[L].shape[1] - 1
        keys = self.pools.ikeys[L][slots, :n]  # [B, n, di]
        scores = (torch.relu(q.float() @ keys.float().transpose(1, 2)) * w[..., None]).sum(1)  # [B, n]
        visible = (pos + 1) // CSA_RATIO
        scores = scores.masked_fill(torch.arange(n, device=q.device)[None] >= visible[:, None], float("-inf"))
        # ascending, as the reference: valid entries (< visible) come first, in the same order
        idx = scores.topk(min(cfg.index_topk, n), dim=-1).indices.sort(-1).values
        return idx, idx < visible[:, None]

    def _attention(self, x, pos, slots, passes, L):
        cfg, P = self.cfg, self.pools
        lw = self.layers[L]
        B, H, hd = x.shape[0], self.heads, cfg.head_dim  # this rank's heads (attn_split)
        r = cfg.ratio(L)
        inv_freq = self.inv_freq[r > 0]
        tr, T = self.triton, self.trace
        eps = cfg.rms_norm_eps
        kw: dict = {"ratio": r}
        split = self.split_peer is not None  # the heads' launches take the full launches' configurations
        heads_kw = {"config": _rn.pick_heads_config(cfg.num_attention_heads, hd)} if split else {}
        if split:
            kw["heads_like"] = cfg.num_attention_heads
        # INDEXER_BESIDE_ROWS: the indexer on its own stream, beside the attention's wq_b
        # (one GPU without the CPU sidecar: the only setting measured)
        few = (r == CSA_RATIO and tr and B <= INDEXER_BESIDE_ROWS and (self.world_size == 1 or BESIDE_ON_RANKS)
               and self.sidecar is None)
        idx_stream = self.idx_stream if few else None
        beside = idx_stream is not None
        keys_ready = torch.cuda.Event() if beside else None
        # INDEXER_FIRST: the indexer's bf16 rows in a launch of their own before the compressor's, and
        # (beside) its q rows on its own stream
        first = few and INDEXER_FIRST
        made = []  # what the side stream allocates, joined below
        if r:  # the compressors' (and the indexer's) bf16 projections and updates, beside the q/kv path
            with self._on_side():
                with stage(T, "attn_proj", L):
                    wd, sizes = lw["x_dense"]
                    if first:  # rows [lo, end): the indexer's compressor and weights_proj, with the whole
                        # launch's configuration, so each output is the same sum (LinearGroup.part's rule)
                        lo, whole = sizes[0] + sizes[1], _dense.pick_config(wd.shape[0], wd.shape[1])
                        made.append(self._dense(x, wd[lo:], config=whole))
                        xd = [None, None, *made[0].split(sizes[2:], dim=1)]
                    else:
                        made.append(self._dense(x, wd))
                        xd = made[0].split(sizes, dim=1)
                if r == CSA_RATIO:
                    with stage(T, "indexer", L):
                        self._compress(xd[2], xd[3], pos, passes, L, "idx")
                    if beside:
                        keys_ready.record()
                if first:
                    with stage(T, "attn_proj", L):
                        made.append(self._dense(x, wd[:lo], config=whole))
                        xd[0], xd[1] = made[1].split(sizes[:2], dim=1)
                with stage(T, "compressor", L):
                    self._compress(xd[0], xd[1], pos, passes, L, "comp")
            kw["comp"] = P.cent[L]
        with stage(T, "attn_proj", L):  # every projection of x and of qr
            # QNORM_TAIL_ROWS: qr = the q norm of qa (with its fp8 codes) made by the x group's launch
            tail = lw["x_fp8"].with_norm_tail(x, (lw["q_norm"], eps)) if tr and B <= QNORM_TAIL_ROWS else None
            (qa, kv), qr, qrq = tail or (lw["x_fp8"](x, tr), None, None)
            with self._on_side():  # beside the q path below
                # kv norm, RoPE, fp8 simulation of the nope dims, and the write into the window ring
                self._kernel(_rn, "kv_rope_sim_store")(kv, lw["kv_norm"], inv_freq, pos, P.win[L], slots,
                                                       eps, cfg.nope_head_dim)
            if tail is None:  # the norm's own launch; it also writes qr's fp8 codes, which qr_fp8 loads
                qr, qrq = (_rn.rms_norm(qa, lw["q_norm"], eps, codes=True) if tr
                           else (_rn.rms_norm_ref(qa, lw["q_norm"], eps), None))
            if beside and not first:  # the indexer's rows of the qr group first: the indexer starts on them
                qi = lw["qr_fp8"].part(1, qr, tr, codes=qrq)
            elif not beside:
                qb = lw["qr_fp8"](qr, tr, codes=qrq)
        if beside:
            with self._on_side(idx_stream, "indexer"), stage(T, "indexer", L):
                if first:  # beside wq_b instead of before it
                    qi = lw["qr_fp8"].part(1, qr, tr, codes=qrq)
                kw["idx"], kw["idx_ok"] = self._indexer(qi, xd[4], pos, slots, L, keys_ready)
        with stage(T, "attn_proj", L):
            qh = lw["qr_fp8"].part(0, qr, tr, codes=qrq) if beside else qb[0]  # the attention's wq_b
            q = self._kernel(_rn, "q_norm_rope")(qh.view(B, H, hd), inv_freq, pos, eps, **heads_kw)
        self._join(*made)  # the side stream's work of this layer so far
        if beside:
            self._join(kw["idx"], kw["idx_ok"], stream=idx_stream)
        elif r == CSA_RATIO:
            with stage(T, "indexer", L):
                kw["idx"], kw["idx_ok"] = self._indexer(qb[1], xd[4], pos, slots, L)
        with stage(T, "attention", L):
            # window ring + selected / visible compressed entries read in place from the pools,
            # sinks, and the inverse RoPE of the output, in one kernel
            attn = (self._kernel(_attn, "sparse_attention_pools") if q.dtype == torch.bfloat16
                    else _attn.sparse_attention_pools_ref)  # the torch twin also takes fp32
            o = attn(q, P.win[L], slots, pos, lw["sink"], hd**-0.5, self.rope[r > 0], window_size=cfg.sliding_window,
                     **kw)
        with stage(T, "out_proj", L):
            G, R = cfg.o_groups, cfg.o_lora_rank
            if not split:
                u, wo_b = lw["wo_a"].grouped(o.reshape(B, G, -1), G, R, tr), lw["wo_b"]
                if (tr and B <= WO_B_PARTS_ROWS and wo_b.kernel_block and wo_b.scale is not None
                        and u.dtype == torch.bfloat16):
                    return _wo_b_partials(u, wo_b, wo_b.w.shape[1])  # the next mixes launch sums them
                return wo_b(u, tr)
            # this rank's groups of wo_a, then its splits of wo_b, gathered and summed with the others'
            wo_a, wo_b, Gl = lw["wo_a"], lw["wo_b"], G // self.world_size
            u = wo_a.grouped(o.reshape(B, Gl, -1), Gl, R, tr, config=_lin.pick_config(B, G * R, wo_a.w.shape[1]))
            _wo_b_partials(u, wo_b, wo_b.w.shape[1] * self.world_size, out=self.split_peer.buffer(L, B))
            return self.split_peer.combine(L, B)

    def _pairs_to_mhc(self, rows: int) -> bool:
        """Whether a MoE sublayer of `rows` rows leaves its routed pairs to the next mHC launch (MOE_PAIRS_ROWS)."""
        return rows <= MOE_PAIRS_ROWS

    def _moe_plan(self, rows: int) -> tuple[str, bool, str]:
        """(router, shared_after_router, shared_w2) of a step of `rows` rows: the constructor's
        choices, or the plan's for that many rows ("triton" where the CUDA routing does not run):
        MOE_PLAN on one GPU, MOE_PLAN_EP with several ranks and the peer-to-peer combine, else
        MOE_PLAN_ABOVE."""
        plan = MOE_PLAN if self.world_size == 1 else MOE_PLAN_EP if self.peer is not None else ()
        router, after, w2 = next((tuple(p[1:]) for p in plan if rows <= p[0]), MOE_PLAN_ABOVE)
        router = self.router or (router if self.route_cuda_ok else "triton")
        return (router, after if self.shared_after_router is None else self.shared_after_router,
                self.shared_w2 or w2)

    def check_waits(self) -> None:
        """Raise if a device-side wait of the steps run since the last call gave up (~2 s; it
        leaves wrong values instead of hanging the device): the zero-copy sidecar's wait for the
        CPU. Syncs where one can have run."""
        if self.sidecar is not None:
            self.sidecar.check()

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, block: int = 1) -> torch.Tensor:
        """One decode step (see `_step`), its kernels launched with this decoder's PDL setting."""
        pdl = self.pdl
        if pdl is None:
            # (not with the CPU sidecar or the all-reduce combine: never measured there)
            limit = PDL_MAX_ROWS if self.world_size == 1 else PDL_MAX_ROWS_EP if self.peer is not None else 0
            pdl = self.triton and self.sidecar is None and tokens.shape[0] <= limit
        old = _common.set_pdl(pdl)
        try:
            return self._step(tokens, pos, slots, block)
        finally:
            _common.set_pdl(old)

    def _step(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, block: int = 1) -> torch.Tensor:
        """tokens, pos, slots: int64 [B] on the device. Returns fp32 logits [B, vocab].

        Several rows may belong to one sequence (same slot) when they hold consecutive positions:
        a multi-token block, causal within the block (each row sees the block's earlier rows, as
        if the tokens were decoded one by one). `block` (static: one CUDA graph per value) bounds
        the rows per sequence, at most the decoder's max_block. Every projection, the window ring
        write and attention treat the block's rows together; only the compressors, whose state a
        row advances, run `block` passes, pass t updating the rows that are their sequence's t-th
        (the other rows aimed at the dummy slot). A caller that puts more than `block` rows of a
        sequence in a step gets wrong state (nothing on the device checks it)."""
        if not 1 <= block <= self.pools.max_block:
            raise ValueError(f"block must be in 1..{self.pools.max_block} (the decoder's max_block), got {block}")
        cfg, T, eps = self.cfg, self.trace, self.cfg.rms_norm_eps
        for peer in (self.peer, self.split_peer, self.vocab_peer):
            if peer is not None:
                peer.begin_step()
        mhc_pre, mhc_post = self._kernel(_mhc, "mhc_pre"), self._kernel(_mhc, "mhc_post")
        post_pre = self._kernel(_mhc, "mhc_post_pre")  # a sublayer's stream update + the next one's mixes
        hc, iters, hc_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        if block == 1:
            passes = [slots]
        else:  # a row's rank within its sequence: the rows of its slot at earlier positions
            rank = ((slots[None, :] == slots[:, None]) & (pos[None, :] < pos[:, None])).sum(1)
            dummy = torch.full_like(slots, self.pools.dummy_slot)
            passes = [torch.where(rank == t, slots, dummy) for t in range(block)]
        with stage(T, "embed"):
            # each row's embedding in its hc streams by one gather (an expanded index: no copy launch)
            h = self.embed[tokens[:, None].expand(-1, hc)].to(self.dtype)
        # sublayers in order (attention, then FFN, of each layer); each one's update of the streams
        # shares a launch with the next one's mixes (mhc_post_pre), the last one's stands alone
        subs = [(L, kind) for L in range(len(self.layers)) for kind in ("attn", "ffn")]

        def mixes(i: int):
            lw = self.layers[subs[i][0]]
            return (*lw[f"hc_{subs[i][1]}"], lw[f"{subs[i][1]}_norm"], hc, iters, hc_eps, eps)

        # MHC_SINKHORN_BESIDE_ROWS: post and comb are made on another stream, joined before their use
        beside = (self.triton and self.side_stream is not None and (self.world_size == 1 or BESIDE_ON_RANKS)
                  and self.sidecar is None and tokens.shape[0] <= MHC_SINKHORN_BESIDE_ROWS)
        lo, hi = MHC_SINKHORN_OWN_STREAM_ROWS
        hc_stream = self.hc_stream if lo <= tokens.shape[0] <= hi else self.side_stream
        sk = {"sinkhorn_stream": hc_stream} if beside else {}
        with stage(T, "mhc_pre", 0):
            x, post, comb = mhc_pre(h, *mixes(0), **sk)
        for i, (L, kind) in enumerate(subs):
            y = self._attention(x, pos, slots, passes, L) if kind == "attn" else self._moe(x, tokens, L)
            y, y2 = y if isinstance(y, tuple) else (y, None)  # (routed sum, shared output): shared_w2 "mhc"
            if beside:
                self._join(stream=hc_stream)
            if i + 1 < len(subs):
                with stage(T, "mhc_pre", subs[i + 1][0]):
                    h, x, post, comb = post_pre(_rows_unit(y), h, post, comb, *mixes(i + 1), y2=y2, **sk)
            else:
                with stage(T, "mhc_post", L):
                    h = mhc_post(_rows_unit(y), h, post, comb, y2=y2)
        with stage(T, "head"):
            z = self._kernel(_mhc, "mhc_head")(h, *self.hc_head, self.norm_w, hc_eps, eps)
            if self.vocab_peer is None:
                return self._dense(z, self.head)
            B = z.shape[0]
            _dense.linear_bf16(z, self.head, torch.float32, config=self.head_config, out=self.vocab_peer.buffer(B))
            return self.vocab_peer.gather(B)
