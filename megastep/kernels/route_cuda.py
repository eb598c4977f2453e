"""The MoE routing after the gate GEMV in one CUDA C++ launch (`route_cuda.cu`): router.py's
`route_group` (route, then the experts' pair grouping and x quantized for them) or `route`,
for any batch. On CUDA devices FastDecoder takes it after `dense.linear_bf16`'s gate in place of
router.py's launches (the fused `gate_route_group`, `route_group`, `route`, and the gather of a
hash layer's tid2eid rows), with the same results bit for bit.

Semantics (router.py's module doc; torch twins `route_ref` / `route_group_ref`), per row of
logits fp32 [B, E]:
    scores = sqrt(softplus(logits))                    softplus as torch (x > 20: x)
    idx    = topk(scores + bias, k) (lowest id among equal keys), or tid2eid[tokens], ascending
    w      = scores[idx] / sum(scores[idx]) * scaling  the sum in ascending expert order
and with `group` the (row, slot) pairs grouped by expert and x [B, D] quantized per 128-block
(`moe_route.moe_route`'s semantics, permuted per 32-group when `permute`).
The same operations as the Triton functions (libdevice's expf / log1pf without flush-to-zero,
sqrt and division correctly rounded, the same sum orders), so equal logits give equal results:
a step may take either launch (the GPU tests check it bit for bit).

Why CUDA C++: the Triton routing tail is a chain of cross-warp reductions and L2 round trips in
one program; here a warp routes a row with shuffles and redux.sync, its operands loaded up front.
Measured on one H200 (docs/PERFORMANCE.md, thirteenth measurement, benchmarks/kernels/route_probe.py),
us per call after the gate GEMV, with grouping and x's quantization: 4.07 against router.py's
6.67 at 1 row, 4.32 against 7.32 at 4, 6.54 against 17.0 at 16; routing alone 3.28-3.60 against
`route`'s 4.1-4.2. FastDecoder takes it by rows (MOE_PLAN).

Grid: R = ceil(B / 8) routing CTAs (a warp per row) and, with `group`, a CTA per 8 of x's
128-blocks; the last routing CTA to arrive groups (an arrival counter it resets; none when R = 1).

`gate_route_group` takes the gate GEMV into the same launch for up to 8 rows (FUSED_GATE_ROWS; off:
measured slower): `dense.linear_bf16`'s sums for the gate (the .cu says how), then the same routing,
grouping and quantization, so the same results bit for bit.
The experts per lane (E / 32) are fixed at build time, one build per expert count. Static grids,
so CUDA graphs capture it; built and loaded at the first call (`cuda_module`), which must come
before any capture (the runtime's warm-up steps do it).
"""

from __future__ import annotations

import functools
import os

import torch

from megastep.kernels import moe_route as _mr
from megastep.kernels.common import pdl_enabled, workspace
from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "route_cuda.cu")
SIGNATURES = {"route_group": "pqppqpppfpqpqppppppiiiii",  # the kernels' arguments by kind (cuda_module.Kernel)
              "gate_route_group": "pqpqpppqpppfpqppppppiiii"}
THREADS = 256
ROWS_PER_CTA = THREADS // 32  # a warp per row
MAX_EXPERTS = 512  # 16 experts per lane
MAX_TOPK = 32  # a warp's lanes
MAX_GROUPED_PAIRS = THREADS  # the grouping: a thread per pair
# Steps of at most this many rows (and 8 at most: one MMA's columns) take gate_route_group, the gate GEMV
# inside the routing's launch (`gate_route_group` below), where FastDecoder routes with this module. 0:
# never. Off: measured 2026-12-05 (benchmarks/h200_checks.sh `one` and `arms2`; docs/PERFORMANCE.md,
# twenty-eighth measurement), the 30-layer step 4.0-4.3 % slower at 1 row, 2.5-5.4 % at 2-4: gate-up,
# launched under PDL, holds its SMs waiting for the longer launch and the shared expert starts late.
# Again with the 1-row ring gate-up on 112 CTAs (2026-12-06 from 18:18, one H100, 16 layers, group `fgate`
# at 90bd690): +2.78 % at 1 row; taken up to 4 rows, +4.27 % at 2 and +2.80 % at 4. At 1 row the routing
# ended 0.8 us sooner and gate-up 4 us later.
FUSED_GATE_ROWS = 0
FUSED_MAX_ROWS = 8


def build_flags(E: int) -> tuple[str, ...]:
    """nvcc flags of the build for E experts: their count per lane is fixed at build time."""
    return (f"-DEXPERTS_PER_LANE={E // 32}",)


@functools.cache
def _module(E: int) -> CudaModule:
    return CudaModule(SOURCE, extra_flags=build_flags(E))


@functools.cache
def kernel_for(E: int, name: str = "route_group"):
    """Kernel `name` built for E experts (one build per expert count, cached)."""
    return _module(E).kernel(name, SIGNATURES[name])


@functools.cache
def _have_nvcc() -> bool:
    return find_nvcc() is not None


def supported(device: torch.device, E: int, D: int, k: int) -> bool:
    """Whether the CUDA routing runs here: a CUDA device, nvcc, E a multiple of 32 up to
    MAX_EXPERTS, top-k up to MAX_TOPK, D a multiple of 128 (x's quantization blocks)."""
    return (device.type == "cuda" and E % 32 == 0 and 32 <= E <= MAX_EXPERTS and 1 <= k <= min(MAX_TOPK, E)
            and D % 128 == 0 and _have_nvcc())


def _check_rows(bias, tid2eid, tokens, B: int, E: int, k: int, dev: torch.device) -> None:
    """The routing's inputs besides the logits: bias [E] f32 or None; tid2eid [V, k] int64 with tokens
    [B] int64, or None."""
    if bias is not None:
        assert bias.shape == (E,) and bias.dtype == torch.float32 and bias.is_contiguous() and bias.device == dev
    if tid2eid is not None:
        assert tid2eid.dim() == 2 and tid2eid.shape[1] == k and tid2eid.dtype == torch.int64 and tid2eid.stride(1) == 1
        assert tokens is not None and tokens.shape == (B,) and tokens.dtype == torch.int64 and tokens.is_contiguous()


def route_group(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                tokens: torch.Tensor | None, k: int, scaling: float, x: torch.Tensor | None = None,
                permute: bool = True, kernel=None) -> tuple[torch.Tensor, torch.Tensor, _mr.Routing | None]:
    """logits [B, E] f32 (the gate GEMV), bias [E] f32 (top-k layers) or None, tid2eid [V, k] int64
    with tokens [B] int64 (hash layers) or None -> (idx [B, k] int32 ascending, w [B, k] f32,
    routing). With x [B, D] bf16 (B * k <= MAX_GROUPED_PAIRS) routing is the pairs grouped by
    expert and x quantized, as `router.route_group` gives them; without x it is None. kernel: a
    variant build of route_group for E experts (benchmarks/kernels/route_probe.py), else this
    module's."""
    B, E = logits.shape
    dev = logits.device
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.dtype, logits.stride())
    D = x.shape[1] if x is not None else 128
    assert supported(dev, E, D, k), (dev, E, D, k)
    _check_rows(bias, tid2eid, tokens, B, E, k, dev)
    group = x is not None
    if group:
        assert x.shape[0] == B and x.dtype == torch.bfloat16 and x.device == dev, (x.shape, x.dtype)
        assert x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0, "x rows must be 8-byte aligned"
        assert 1 <= B * k <= MAX_GROUPED_PAIRS, (B, k)
    idx = torch.empty(B, k, dtype=torch.int32, device=dev)
    w = torch.empty(B, k, dtype=torch.float32, device=dev)
    if B == 0:
        return idx, w, None
    if group:
        pairs, slot_e, slot_start, slot_cnt, nslots, xq = _mr.routing_buffers(B * k, E, x, dev)
        ptrs = (x, x.stride(0), xq, xq.stride(0), pairs, slot_e, slot_start, slot_cnt, nslots)
    else:
        ptrs = (0, 0, 0, 0, 0, 0, 0, 0, 0)
    routing_ctas = -(-B // ROWS_PER_CTA)
    quant_ctas = -(-(B * D // 128) // ROWS_PER_CTA) if group else 0
    cnt = workspace(dev, "counters_route_cuda", 1, torch.int32)
    hashed = tid2eid is not None
    (kernel or kernel_for(E)).launch((routing_ctas + quant_ctas, 1, 1), (THREADS, 1, 1), 0, None,
                               logits, logits.stride(0), 0 if bias is None else bias, tid2eid if hashed else 0,
                               tid2eid.stride(0) if hashed else 0, tokens if hashed else 0, idx, w, float(scaling),
                               *ptrs, cnt, B, D, k, int(group), int(permute), pdl=pdl_enabled())
    routing = _mr.Routing(pairs, slot_e, slot_start, slot_cnt, nslots, xq, permute) if group else None
    return idx, w, routing


def fused_gate_ok(x: torch.Tensor, gate: torch.Tensor, k: int) -> bool:
    """Whether gate_route_group takes this step: at most FUSED_GATE_ROWS (<= 8) rows, bf16 x and gate,
    the gate's configuration one 128-column step per split (dense.linear_bf16's, so the same sums),
    whole CTAs of warp tasks, 16-byte-aligned rows, the grouping's pair limit, `supported`."""
    from megastep.kernels import dense

    B, D = x.shape
    E = gate.shape[0]
    if not 0 < B <= min(FUSED_GATE_ROWS, FUSED_MAX_ROWS) or x.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16:
        return False
    cfg = dense.pick_config(E, D)
    if cfg.block_k != 128 or dense.split_plan(D, cfg) != (D // 128, 128) or B * k > MAX_GROUPED_PAIRS:
        return False
    if E % 16 or (E // 16) * (D // 128) % ROWS_PER_CTA:  # whole CTAs of (16 experts, split) warp tasks
        return False
    if x.stride(1) != 1 or gate.stride(1) != 1 or x.stride(0) % 8 or gate.stride(0) % 8 or x.data_ptr() % 16 \
            or gate.data_ptr() % 16:
        return False
    return supported(x.device, E, D, k)


def gate_route_group(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                     tokens: torch.Tensor | None, k: int, scaling: float, permute: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, _mr.Routing]:
    """route_group(dense.linear_bf16(x, gate), ..., x) in one launch, the same results bit for bit: x
    [B, D] bf16 (B <= 8), gate [E, D] bf16; the rest as route_group's. Call it where fused_gate_ok."""
    B, D = x.shape
    E = gate.shape[0]
    dev = x.device
    assert fused_gate_ok(x, gate, k), (x.shape, gate.shape, k)
    _check_rows(bias, tid2eid, tokens, B, E, k, dev)
    hashed = tid2eid is not None
    idx = torch.empty(B, k, dtype=torch.int32, device=dev)
    w = torch.empty(B, k, dtype=torch.float32, device=dev)
    pairs, slot_e, slot_start, slot_cnt, nslots, xq = _mr.routing_buffers(B * k, E, x, dev)
    S = D // 128
    part = workspace(dev, "partials_gate_route", S * E * FUSED_MAX_ROWS, torch.float32)
    cnt = workspace(dev, "counters_gate_route_cuda", 1, torch.int32)
    gate_ctas = (E // 16) * S // ROWS_PER_CTA  # a warp per (16 experts, split)
    quant_ctas = -(-(B * D // 128) // ROWS_PER_CTA)
    kernel_for(E, "gate_route_group").launch(
        (gate_ctas + quant_ctas, 1, 1), (THREADS, 1, 1), 0, None,
        x, x.stride(0), gate, gate.stride(0), part, 0 if bias is None else bias, tid2eid if hashed else 0,
        tid2eid.stride(0) if hashed else 0, tokens if hashed else 0, idx, w, float(scaling), xq, xq.stride(0),
        pairs, slot_e, slot_start, slot_cnt, nslots, cnt, B, D, k, int(permute), pdl=pdl_enabled())
    return idx, w, _mr.Routing(pairs, slot_e, slot_start, slot_cnt, nslots, xq, permute)
