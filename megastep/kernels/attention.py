"""Sparse attention for decode with one shared KV head (K = V) and attention sinks.

Semantics (`sparse_attention_decode_ref` = `ops.sparse_attention`, MODEL_SPEC §3), per row b and
head h, in fp32: s_j = (q_h . kv_j) * scale over the valid entries j; m = max_j s_j;
o_h = sum_j e^(s_j - m) kv_j / (sum_j e^(s_j - m) + e^(sink_h - m)), rounded to bf16.
Masked entries weigh exactly 0 whatever their (finite) kv rows hold.

Kernel (flash-decoding): grid (H / BLOCK_H, S, B). Program (hb, s, b) takes BLOCK_H heads of row
b and the KV entries [s*CHUNK, (s+1)*CHUNK); it loads each BLOCK_N x d tile of KV once and uses
it for all its heads, both as K (scores) and as V (weighted sum), keeping a running max, sum and
fp32 accumulator. The head-block programs of one KV chunk are neighbouring program ids, so the
KV comes from HBM once and from L2 after that. With S > 1 the chunk results go to fp32 partials
and the last program of (b, hb) to arrive (an int32 arrival counter, reset by that program; no
atomics on data) combines them in chunk order 0..S-1. S depends on N only, never on B, so a
row's result does not depend on the batch (batch invariant); the order is fixed (deterministic).

Precision: scores are tensor-core dots of bf16 q and kv (exact products, fp32 accumulation). The
weights p (fp32) are split into PV_PIECES bf16 pieces p = p1 + p2 (+ p3) + r, each piece exact in
bf16 and multiplied exactly against the bf16 kv with fp32 accumulation: two pieces leave
|r| <= 2^-17 |p|, below the fp32 summation noise of the sum over entries, at twice the
tensor-core work of a bf16 P. Under the Triton interpreter the same pieces are multiplied as fp32
operands (its bf16 dot is wrong), so the CPU tests check exactly the GPU's arithmetic.
What differs from the reference: fp32 summation orders, the online-softmax rescaling across
tiles and chunks, and dividing the weighted sum by the denominator instead of each weight.
A row with no valid entry gives 0 (the reference gives NaN there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels.common import next_pow2, on_interpreter, round_bf16, workspace
from megastep.model import ops

_COUNTERS = 1 << 14  # arrival counters kept per device (B x head blocks)


@dataclass(frozen=True)
class AttnConfig:
    block_h: int  # heads per program
    block_n: int  # KV entries per loop step
    chunk: int  # KV entries per program (a multiple of block_n); S = cdiv(N, chunk)
    pv_pieces: int = 2  # bf16 pieces of the softmax weights in the weighted sum
    num_warps: int = 8
    num_stages: int = 2

    def check(self) -> None:
        assert self.block_h in (16, 32, 64), self
        assert self.block_n in (16, 32, 64), self
        assert self.chunk >= self.block_n and self.chunk % self.block_n == 0, self
        assert self.pv_pieces in (2, 3), self  # one bf16 piece misses the ref by bf16 steps


def pick_config(H: int, N: int, d: int) -> AttnConfig:
    """The one configuration for (heads, entries, head dim); it never depends on B. Chunks are
    sized so that the fp32 partials (H x d x 4 bytes per chunk) are no larger than the KV bytes
    they summarize (chunk x d x 2) from 128 entries on, while B = 1 still gets several programs.
    Not measured on the device yet."""
    del d
    bh = 16 if H <= 16 else 32
    chunk = 64 if N <= 256 else 128 if N <= 1024 else 256
    return AttnConfig(bh, 32, chunk, pv_pieces=2, num_warps=8, num_stages=2)


@triton.jit
def _sparse_attn_kernel(
    q_ptr, kv_ptr, valid_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr, cnt_ptr,
    H, N, scale,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_vb, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PIECES: tl.constexpr, INTERPRET: tl.constexpr,
    DC: tl.constexpr, GROUP: tl.constexpr,
):
    hb = tl.program_id(0)  # fastest: the head blocks of one KV chunk run side by side
    s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_hb = tl.num_programs(0)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    n_lo = s * CHUNK
    n_hi = tl.minimum(n_lo + CHUNK, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_in = offs_n < n_hi
        ok = tl.load(valid_ptr + b * stride_vb + offs_n, mask=n_in, other=0) != 0
        kv = tl.load(kv_ptr + b * stride_kb + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_in[:, None], other=0.0)
        if INTERPRET:
            kv = kv.to(tl.float32)
        sc = tl.dot(q, tl.trans(kv)) * scale  # [BLOCK_H, BLOCK_N]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: weights 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        r = p
        for i in tl.static_range(PIECES):
            piece = round_bf16(r, INTERPRET)  # fp32 holding the nearest bf16
            if INTERPRET:
                acc = acc + tl.dot(piece, kv)
            else:
                acc = tl.dot(piece.to(tl.bfloat16), kv, acc)
            if i < PIECES - 1:
                r = r - piece  # exact
        m_i = m_new

    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    out_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
    if SPLIT == 1:
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        o = acc / (l_i + tl.exp(sink - m_use))[:, None]
        tl.store(out_ptrs, round_bf16(o, INTERPRET).to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        # partials: acc [B, SPLIT, H, D], (m, l) [B, SPLIT, 2, H]
        pa_row = pacc_ptr + (b * SPLIT) * H * D
        pml_row = pml_ptr + (b * SPLIT) * 2 * H
        tl.store(pa_row + (s * H + offs_h)[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None])
        tl.store(pml_row + s * 2 * H + offs_h, m_i, mask=h_mask)
        tl.store(pml_row + s * 2 * H + H + offs_h, l_i, mask=h_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        tile = b * n_hb + hb
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # last chunk program of (b, hb): combine in chunk order
            tl.debug_barrier()
            ss = tl.arange(0, SPLIT_P2)
            ml_mask = (ss < SPLIT)[:, None] & h_mask[None, :]
            m_all = tl.load(pml_row + ss[:, None] * 2 * H + offs_h[None, :], mask=ml_mask, other=float("-inf"),
                            cache_modifier=".cg")
            l_all = tl.load(pml_row + ss[:, None] * 2 * H + H + offs_h[None, :], mask=ml_mask, other=0.0,
                            cache_modifier=".cg")
            m = tl.max(m_all, axis=0)
            m_use = tl.where(m == float("-inf"), 0.0, m)
            a_all = tl.exp(m_all - m_use[None, :])  # [SPLIT_P2, BLOCK_H] chunk weights, 0 past SPLIT
            den = tl.sum(l_all * a_all, axis=0) + tl.exp(sink - m_use)
            # the weighted sum over chunks in order, by DC-wide column slabs, GROUP chunks in flight
            for d0 in range(0, D, DC):
                offs_c = d0 + tl.arange(0, DC)
                acc_c = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
                for g in range(0, SPLIT, GROUP):
                    for i in tl.static_range(GROUP):
                        a_s = tl.sum(tl.where(ss[:, None] == g + i, a_all, 0.0), axis=0)
                        rows = tl.zeros([BLOCK_H], dtype=tl.int32) + (g + i)
                        v = tl.load(pa_row + ((g + i) * H + offs_h)[:, None] * D + offs_c[None, :],
                                    mask=(h_mask & (rows < SPLIT))[:, None], other=0.0, cache_modifier=".cg")
                        acc_c = acc_c + v * a_s[:, None]
                o = acc_c / den[:, None]
                tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_c[None, :],
                         round_bf16(o, INTERPRET).to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
            tl.store(cnt_ptr + tile, 0)


def sparse_attention_decode(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                            scale: float, config: AttnConfig | None = None) -> torch.Tensor:
    """q [B, H, d] bf16, kv [B, N, d] bf16 (K = V), valid [B, N] bool, sink [H] f32 -> [B, H, d] bf16."""
    assert q.dim() == 3 and kv.dim() == 3 and valid.dim() == 2, (q.shape, kv.shape, valid.shape)
    B, H, d = q.shape
    N = kv.shape[1]
    assert kv.shape == (B, N, d) and valid.shape == (B, N), (q.shape, kv.shape, valid.shape)
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, (q.dtype, kv.dtype)
    assert valid.dtype == torch.bool, valid.dtype
    assert sink.shape == (H,) and sink.dtype == torch.float32 and sink.is_contiguous()
    assert d >= 16 and d & (d - 1) == 0, "head_dim must be a power of two"
    assert q.stride(2) == 1 and kv.stride(2) == 1 and valid.stride(1) == 1
    assert q.device == kv.device == valid.device == sink.device
    cfg = config or pick_config(H, N, d)
    cfg.check()
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    split = max(1, -(-N // cfg.chunk))
    n_hb = -(-H // cfg.block_h)
    if split > 1:
        pacc = torch.empty(B * split * H * d, dtype=torch.float32, device=q.device)
        pml = torch.empty(B * split * 2 * H, dtype=torch.float32, device=q.device)
        cnt = workspace(q.device, "counters_attn", max(B * n_hb, _COUNTERS), torch.int32)
    else:
        pacc = pml = cnt = out  # unused
    _sparse_attn_kernel[(n_hb, split, B)](
        q, kv, valid.view(torch.uint8), sink, out, pacc, pml, cnt,
        H, N, float(scale),
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), valid.stride(0), out.stride(0), out.stride(1),
        D=d, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk, SPLIT=split, SPLIT_P2=next_pow2(split),
        PIECES=cfg.pv_pieces, INTERPRET=on_interpreter(q), DC=min(d, 128), GROUP=min(4, split), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def sparse_attention_decode_ref(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                                scale: float, config: AttnConfig | None = None) -> torch.Tensor:
    """`ops.sparse_attention` itself."""
    del config
    return ops.sparse_attention(q, kv, sink, scale, valid)
