"""The routed MXFP4 experts' weight launches in CUDA C++ (`moe_lut.cu`): mode "lut" of
`kernels/moe.py`, whose `moe_experts_table` calls these two functions in place of its Triton
gate-up and down kernels (routing, the activation quantization between them and the reference,
`moe_experts_mxfp4_ref`, are moe.py's).

Shapes and dtypes (P = M * topk pairs, E experts, table strides in bytes):
    gate_up: xq bf16 [M, D] (x quantized, natural order) -> act bf16 [P, I]
    down:    aq bf16 [P, I] (act quantized, natural order) -> y bf16 [P, D] per pair, and with
             combine the fp32 [M, D] sum over each row's slots in slot order
D and I multiples of 512, x in bf16 (`supported`). Why CUDA C++: the decode is a shared-memory
table lookup whose address one `prmt` forms, and each lane's MMA operands stay in its registers
with a block-diagonal B so every MXFP4 group's scale multiplies only its own sum (the .cu
explains both); Triton expresses neither. Measured against the Triton "dot_asm" kernels in
docs/PERFORMANCE.md (tenth measurement).

Grids are static (at most 2 CTAs of 256 threads per SM, each taking (expert slot, 64 weight rows)
items in turn), so launches are captured by CUDA graphs; build and load happen at the first
call (`cuda_module`), which must come before any capture (the runtime's warm-up steps do it).
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

from megastep.kernels.common import pdl_enabled, workspace
from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_lut.cu")
_MODULE = CudaModule(SOURCE)
_GATE_UP = _MODULE.kernel("moe_gate_up_lut", "pqppppppppqiiqqfiii")
_DOWN = _MODULE.kernel("moe_down_lut", "pqpppppppqpqpiiqqiiipq")
# The quarter kernels (the .cu's run with kKS > 0): K's four quarters summed apart, added as
# (q0 + q1) + (q2 + q3), with ks = 1 or 2 CTAs per item along K (the same bits for either; other
# bits than the kernels above). An experiment, not used by the runtime: at 1 row the 384 items
# fill 264 CTA slots in two rounds, the second at 45 % occupancy, and ks = 2 spreads half-size
# items over ~2.9 rounds instead (docs/PERFORMANCE.md, thirteenth measurement, "where batch 1
# stands"). KSPLIT = 1 or 2 routes this module's calls to them (benchmarks/kernels/moe_cuda_variants.py
# --engines lut_q1,lut_q2); 0 keeps the kernels above.
_GATE_UP_Q = _MODULE.kernel("moe_gate_up_lut_q", _GATE_UP.signature + "ppii")
_DOWN_Q = _MODULE.kernel("moe_down_lut_q", _DOWN.signature + "ppii")
KSPLIT = 0
THREADS = 256
CTAS_PER_SM = 2  # the kernels' __launch_bounds__ minimum (registers and shared memory allow 2)
LUT_BYTES = 256 * 256  # the decode table: 256 entries x 32 lanes' copies, 256 B apart


@functools.cache
def _have_nvcc() -> bool:  # looked up once: `supported` runs on every eager experts call
    return find_nvcc() is not None


def supported(device: torch.device, dtype: torch.dtype, D: int, I: int) -> bool:
    """Whether mode "lut" can run: a CUDA device, nvcc to build the kernels, bf16 activations,
    D and I multiples of 512 (a K half of whole 128-byte steps)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and D % 512 == 0 and I % 512 == 0 and _have_nvcc()


def shared_bytes(K: int) -> int:
    """Dynamic shared memory of a launch over K: the table, then the .cu's Layout(K)."""
    row = K // 32 * 80
    rowpitch = (row + 63) // 128 * 128 + 64
    zero_off = 2 * rowpitch + 8
    red_off = (zero_off + row + 15) // 16 * 16
    return LUT_BYTES + red_off + 4 * 32 * 4 * 4


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(items: int, device: torch.device) -> tuple[int, int, int]:
    return (max(1, min(items, CTAS_PER_SM * _sms(device.index))), 1, 1)


def _quarters(pairs: torch.Tensor, slots: int, tiles: int, nrows: int, K: int) -> tuple:
    """The quarter kernels' extra arguments under KSPLIT (part, kcnt, npairs, ks) and their items."""
    ks = KSPLIT
    assert ks in (1, 2) and K % 1024 == 0, (ks, K)  # a quarter of a row: whole 128-byte steps
    dev = pairs.device
    part = workspace(dev, "moe_lut_part", 2 * pairs.numel() * nrows, torch.float32) if ks == 2 else 0
    kcnt = workspace(dev, "counters_moe_lut_q", slots * tiles, torch.int32) if ks == 2 else 0
    return (part, kcnt, pairs.numel(), ks), slots * tiles * ks


def gate_up(xq, addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, D, I, strides, limit, topk,
            round_bf16, sparse) -> None:
    """act[p] = rnd(r_p * silu(min(rnd(w1 . xq[p // topk]), limit)) * clamp(rnd(w3 . xq), +-limit));
    strides: the table's (w13 row, w13 scale row) strides."""
    assert xq.dtype == act.dtype == torch.bfloat16 and xq.stride(1) == 1 and act.stride(1) == 1
    slots = min(pairs.numel(), addr.shape[0])
    items = slots * (I // 32)  # (slot, 32-channel tile)
    kernel, extra = _GATE_UP, ()
    if KSPLIT:
        kernel = _GATE_UP_Q
        extra, items = _quarters(pairs, slots, I // 32, 2 * I, D)
    kernel.launch(_grid(items, xq.device), (THREADS, 1, 1), shared_bytes(D), None,
                  xq, xq.stride(0), addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, act.stride(0),
                  D, I, strides[0], strides[1], float(limit), int(round_bf16), topk, int(sparse), *extra,
                  pdl=pdl_enabled())


def down(aq, addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, counters, D, I, strides, topk, sparse,
         combine, shared=None) -> None:
    """y[p] = rnd(w2 . aq[p]); with combine out[m] = sum over slots j of y[m * topk + j] (fp32,
    slot order) by the last CTA to finish each (row, 64-row tile), counters [M, D / 64] int32 at
    zero (left at zero). shared (bf16 [M, D]): out is bf16 and receives rnd(that sum + shared).
    strides: the table's (w2 row, w2 scale row) strides."""
    assert aq.dtype == y.dtype == torch.bfloat16 and aq.stride(1) == 1 and y.stride(1) == 1
    if shared is not None:
        assert combine and shared.dtype == out.dtype == torch.bfloat16 and shared.stride(1) == 1, (shared.dtype,
                                                                                                    out.dtype)
    else:
        assert out.dtype == torch.float32, out.dtype
    slots = min(pairs.numel(), addr.shape[0])
    items = slots * (D // 64)  # (slot, 64-row tile)
    kernel, extra = _DOWN, ()
    if KSPLIT:
        kernel = _DOWN_Q
        extra, items = _quarters(pairs, slots, D // 64, D, I)
    kernel.launch(_grid(items, aq.device), (THREADS, 1, 1), shared_bytes(I), None,
                  aq, aq.stride(0), addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, y.stride(0), out,
                  out.stride(0), counters, D, I, strides[0], strides[1], topk, int(sparse), int(combine),
                  0 if shared is None else shared, 0 if shared is None else shared.stride(0), *extra,
                  pdl=pdl_enabled())
