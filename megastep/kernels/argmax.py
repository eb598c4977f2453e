"""Greedy decoding's argmax over the vocabulary, one launch: `argmax_rows(logits)` =
`torch.argmax(logits, dim=-1)` (`argmax_rows_ref`), bit for bit.

Shapes: logits [M, V] fp32 (row stride free, unit column stride) -> int64 [M].

Semantics, torch's: the index of the first maximal value; NaN counts as larger than every number
(the first NaN wins); -0 and +0 are equal (the first of them wins); a row of -inf gives 0.

Why: torch's argmax over one row of the V4 vocabulary (129280) took 35 us of a 5.0 ms 30-layer
step on the H200 (docs/PERFORMANCE.md, fifteenth measurement's timeline), on the step's path after
the lm head. Here CHUNK-wide programs of each row reduce their slice to (key, first index) and the
last program of the row to arrive (an int32 arrival counter that it resets) reduces the row's
partials: the largest key, then the smallest index holding it, so the result depends on no
arrival order. A float's key is common.f32_order_key's uint32 (ordered like the floats, -0 as +0),
NaN's the largest uint32: torch's comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megastep.kernels.common import f32_order_key, launch_opts, pdl_enter, pdl_release, workspace

CHUNK = 4096  # logits per program: the V4 vocabulary in 32 programs per row


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, key_ptr, idx_ptr, cnt_ptr, V, stride_x,
                   CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    pdl_enter(PDL)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=float("-inf"))
    key = tl.where(x != x, 0xFFFFFFFF, f32_order_key(x))  # NaN above every number
    key = tl.where(ok, key, tl.zeros_like(key))  # below every number's key (-inf's is 0x007FFFFF)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, V), axis=0)
    pdl_release(PDL)
    tl.store(key_ptr + row * NCHUNK + c, best)
    tl.store(idx_ptr + row * NCHUNK + c, first)
    tl.debug_barrier()  # the partial is issued before the arrival below releases it
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == NCHUNK - 1:  # the row's last program: every partial is visible
        cs = tl.arange(0, NCHUNK_P2)
        cm = cs < NCHUNK
        keys = tl.load(key_ptr + row * NCHUNK + cs, mask=cm, other=0, cache_modifier=".cg")
        idxs = tl.load(idx_ptr + row * NCHUNK + cs, mask=cm, other=V, cache_modifier=".cg")
        top = tl.max(keys, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(keys == top, idxs, V), axis=0).to(tl.int64))
        tl.store(cnt_ptr + row, 0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for fp32 logits [M, V] (module doc), in one launch."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.shape, logits.dtype)
    M, V = logits.shape
    assert 0 < V < 2**31, V
    out = torch.empty(M, dtype=torch.int64, device=logits.device)
    if M == 0:
        return out
    nchunk = triton.cdiv(V, CHUNK)
    keys = workspace(logits.device, "argmax_keys", M * nchunk, torch.uint32)
    idxs = workspace(logits.device, "argmax_idx", M * nchunk, torch.int32)
    cnt = workspace(logits.device, "counters_argmax", M, torch.int32)
    grid = (M, nchunk)
    _argmax_kernel[grid](logits, out, keys, idxs, cnt, V, logits.stride(0), CHUNK=CHUNK, NCHUNK=nchunk,
                         NCHUNK_P2=triton.next_power_of_2(nchunk), num_warps=4, **launch_opts(logits, grid))
    return out


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
