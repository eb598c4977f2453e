"""One decode step of a KV compressor (MODEL_SPEC §4: HCA ratio 128, CSA ratio 4 with overlapping
windows, and the CSA indexer's own compressor) after its two dense GEMVs, in one launch instead of
~35 torch ops: store the row, pool where a window closes, norm, RoPE, simulation, entry write,
overlap shift.

Semantics (`compressor_step_ref`: FastDecoder._compress from its row store on), per batch row b
at position p = pos[b] in slot s = slots[b], with r = ratio:
- state row (r if overlap else 0) + p % r of kv_pool[s] / score_pool[s] <- kv_row[b] / score_row[b]
  (score_row = wgate.x + ape[p % r]; the wrapper adds ape itself when given it);
- when (p + 1) % r == 0, per channel c: softmax over the pooled rows of the scores, weighted sum
  of the values. Without overlap the rows are the r state rows; with overlap (rows = 2r, width
  2*dim) rows 0..r-1 at column c (the previous window's first half; -inf scores before the first
  window) and rows r..2r-1 at column dim + c (the current window's second half);
  e -> dtype -> rms_norm(norm_w) -> RoPE at p + 1 - r -> kv: fp8 simulation of the nope dims,
  index: Hadamard + fp4 simulation -> entries[s, (p + 1) // r - 1];
  with overlap, then rows r..2r-1 (all columns) are copied into rows 0..r-1.
- rows whose window is still open write only their state row (the torch code also writes a
  candidate entry to the discard row n of `entries`; nothing reads it, the kernel leaves it).

Kernel: grid (NCB, B). Program (j, b) owns the channel block C_j = [j*BC, (j+1)*BC) and, with
overlap, the columns C_j and dim + C_j of every state row: it stores its part of the new row,
and on emission loads its whole pooled tile [rows, BC] (the new row comes from registers, not
from the memory it just wrote), computes the softmax over rows exactly as torch (max, exp(s - m),
sum, divide, product, sum; no online rescaling: BC is chosen so the tile fits in registers, e.g.
[128, 32] for HCA), writes e to an fp32 workspace and shifts its own columns. No program reads a
column another program writes. The finish (norm ... entry write) needs the whole row: with one
channel block it follows in the same program; with several, the last program of the row to
arrive (an int32 arrival counter per batch row, reset by that program; no atomics on data) does
it. Nothing depends on B (batch invariant) and the finish reads e in a fixed order
(deterministic). Rows of the batch that share a slot (padding rows on the dummy slot) race on
that slot's state as the torch code's index_put does; only the dummy can be shared.

What differs from torch: the fp32 order of the two sums over rows (softmax denominator, weighted
sum) and of the norm's sum of squares; exp is libdevice's __nv_expf on the GPU (torch's CUDA
softmax calls expf), float64-rounded on the interpreter; cos/sin as in rope_norm. After the bf16
rounding of e these rarely show (see tests/kernels/test_compressor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels import rope_norm as _rn
from megastep.kernels.common import launch_opts, next_pow2, on_interpreter, pdl_enter, workspace
from megastep.model import ops

_COUNTERS = 1 << 12  # arrival counters kept per device (one per batch row)


@dataclass(frozen=True)
class CompressorConfig:
    block_c: int  # channels per program (power of two, divides dim)
    num_warps: int = 4


# Pinned per (ratio, overlap, dim): the pooled tile rows x block_c is at most 4096 fp32; registers
# from ptxas for sm_90 (no spills). Not measured on the device yet; B never enters.
_PINNED: dict[tuple[int, bool, int], CompressorConfig] = {
    (4, True, 512): CompressorConfig(512, 8),  # CSA: [8, 512] tile, one program per row (106 regs)
    (4, True, 128): CompressorConfig(128, 4),  # CSA indexer: [8, 128] (48 regs)
    (128, False, 512): CompressorConfig(32, 8),  # HCA: [128, 32] tiles, 16 programs per row (80 regs)
}


def pick_config(ratio: int, overlap: bool, dim: int) -> CompressorConfig:
    cfg = _PINNED.get((ratio, overlap, dim))
    if cfg is not None:
        return cfg
    rows = 2 * ratio if overlap else ratio
    return CompressorConfig(min(dim, max(16, 4096 // next_pow2(rows))), 4)


@triton.jit
def _emit_entry(e_row, w_ptr, rope_ptr, dst, epos, eps,
                HALF: tl.constexpr, LOG_HALF: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
                INDEX: tl.constexpr, TABLE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """e (fp32, written by this launch) -> dtype -> rms_norm -> RoPE at epos -> simulation -> dst."""
    p = tl.arange(0, HALF)[None, :]
    e = _rn.round_to(tl.load(e_row + 2 * p, cache_modifier=".cg"), OUT_BF16, INTERPRET)
    o = _rn.round_to(tl.load(e_row + 2 * p + 1, cache_modifier=".cg"), OUT_BF16, INTERPRET)
    r = _rn.t_rsqrt(tl.div_rn(tl.sum(e * e + o * o, axis=1), 2.0 * HALF) + eps, INTERPRET)[:, None]
    e = _rn.round_to(tl.load(w_ptr + 2 * p) * (e * r), OUT_BF16, INTERPRET)
    o = _rn.round_to(tl.load(w_ptr + 2 * p + 1) * (o * r), OUT_BF16, INTERPRET)
    e, o = _rn.rope_pairs(e, o, p, epos, rope_ptr, NOPE_P, ROPE_P, TABLE, INTERPRET)
    e = _rn.round_to(e, OUT_BF16, INTERPRET)
    o = _rn.round_to(o, OUT_BF16, INTERPRET)
    if INDEX:
        e, o = _rn.hadamard_pairs(e, o, 1, HALF, LOG_HALF)
        e = _rn.round_to(e, OUT_BF16, INTERPRET)
        o = _rn.round_to(o, OUT_BF16, INTERPRET)
        e, o = _rn.fp4_sim_pairs(e, o, p, HALF)
    else:
        e, o = _rn.fp8_sim_pairs(e, o, p, NOPE_P, INTERPRET)
    ty = dst.dtype.element_ty
    tl.store(dst + 2 * p, e.to(ty))
    tl.store(dst + 2 * p + 1, o.to(ty))


@triton.jit
def _compressor_kernel(
    kv_ptr, sc_ptr, ape_ptr, kvp_ptr, scp_ptr, ent_ptr, slot_ptr, pos_ptr, w_ptr, rope_ptr, ews_ptr, cnt_ptr,
    stride_kb, stride_sb, stride_ps, stride_pr, stride_qs, stride_qr, stride_es, stride_en, eps,
    DIM: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr,
    NCB: tl.constexpr, HALF: tl.constexpr, LOG_HALF: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
    INDEX: tl.constexpr, HAS_APE: tl.constexpr, TABLE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    cb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)
    if OVERLAP:
        row = R + pos % R
    else:
        row = pos % R
    c = cb * BC + tl.arange(0, BC)
    kv_st = kvp_ptr + slot * stride_ps
    sc_st = scp_ptr + slot * stride_qs
    if OVERLAP:
        ape_row = ape_ptr + (pos % R) * (2 * DIM)
    else:
        ape_row = ape_ptr + (pos % R) * DIM
    kv_a = tl.load(kv_ptr + b * stride_kb + c)
    sc_a = tl.load(sc_ptr + b * stride_sb + c)
    if HAS_APE:
        sc_a = sc_a + tl.load(ape_row + c)
    tl.store(kv_st + row * stride_pr + c, kv_a)
    tl.store(sc_st + row * stride_qr + c, sc_a)
    if OVERLAP:
        kv_b = tl.load(kv_ptr + b * stride_kb + DIM + c)
        sc_b = tl.load(sc_ptr + b * stride_sb + DIM + c)
        if HAS_APE:
            sc_b = sc_b + tl.load(ape_row + DIM + c)
        tl.store(kv_st + row * stride_pr + DIM + c, kv_b)
        tl.store(sc_st + row * stride_qr + DIM + c, sc_b)
        kv_cur = kv_b  # the new row's pooled columns
        sc_cur = sc_b
    else:
        kv_cur = kv_a
        sc_cur = sc_a
    if (pos + 1) % R == 0:
        rr = tl.arange(0, ROWS)[:, None]
        if OVERLAP:
            col = tl.where(rr < R, 0, DIM) + c[None, :]
        else:
            col = c[None, :] + rr * 0
        new = rr == row
        kvt = tl.load(kv_st + rr * stride_pr + col, mask=~new, other=0.0)
        sct = tl.load(sc_st + rr * stride_qr + col, mask=~new, other=float("-inf"))
        kvt = tl.where(new, kv_cur[None, :], kvt)
        sct = tl.where(new, sc_cur[None, :], sct)
        # torch.softmax over rows, then (values * weights).sum(rows)
        ex = _rn.t_exp(sct - tl.max(sct, axis=0)[None, :], INTERPRET)
        wgt = tl.div_rn(ex, tl.sum(ex, axis=0)[None, :])  # IEEE division, as torch (Triton's / is not)
        tl.store(ews_ptr + b * DIM + c, tl.sum(kvt * wgt, axis=0))
        if OVERLAP:  # the closed window becomes the previous one (all 2*DIM columns)
            r2 = tl.arange(0, R)[:, None]
            new2 = (r2 + R) == row
            ka = tl.where(new2, kv_a[None, :], tl.load(kv_st + (r2 + R) * stride_pr + c[None, :], mask=~new2, other=0.0))
            kb = tl.where(new2, kv_b[None, :], tl.load(kv_st + (r2 + R) * stride_pr + DIM + c[None, :], mask=~new2, other=0.0))
            sa = tl.where(new2, sc_a[None, :], tl.load(sc_st + (r2 + R) * stride_qr + c[None, :], mask=~new2, other=0.0))
            sb = tl.where(new2, sc_b[None, :], tl.load(sc_st + (r2 + R) * stride_qr + DIM + c[None, :], mask=~new2, other=0.0))
            tl.debug_barrier()  # every thread has read the pooled rows 0..R-1 before they are overwritten
            tl.store(kv_st + r2 * stride_pr + c[None, :], ka)
            tl.store(kv_st + r2 * stride_pr + DIM + c[None, :], kb)
            tl.store(sc_st + r2 * stride_qr + c[None, :], sa)
            tl.store(sc_st + r2 * stride_qr + DIM + c[None, :], sb)
        tl.debug_barrier()  # this program's e is written before the finish reads it
        epos = pos + 1 - R
        dst = ent_ptr + slot * stride_es + ((pos + 1) // R - 1) * stride_en
        if NCB == 1:
            _emit_entry(ews_ptr + b * DIM, w_ptr, rope_ptr, dst, epos, eps,
                        HALF, LOG_HALF, NOPE_P, ROPE_P, INDEX, TABLE, OUT_BF16, INTERPRET)
        else:
            arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
            if arrived == NCB - 1:  # the last channel block of row b to finish pooling
                tl.debug_barrier()
                _emit_entry(ews_ptr + b * DIM, w_ptr, rope_ptr, dst, epos, eps,
                            HALF, LOG_HALF, NOPE_P, ROPE_P, INDEX, TABLE, OUT_BF16, INTERPRET)
                tl.store(cnt_ptr + b, 0)


def compressor_step(kv_row: torch.Tensor, score_row: torch.Tensor, kv_pool: torch.Tensor, score_pool: torch.Tensor,
                    entries: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, norm_w: torch.Tensor,
                    rope: torch.Tensor, ratio: int, overlap: bool, kind: str, eps: float,
                    ape: torch.Tensor | None = None, config: CompressorConfig | None = None) -> None:
    """kv_row, score_row [B, W2] f32 (score_row = wgate.x + ape[pos % ratio]); kv_pool, score_pool
    [S, rows, W2] f32 (rows = 2*ratio, W2 = 2*dim with overlap; ratio, dim without); entries
    [S, n+1, dim] bf16/f32; slots, pos [B] i64; norm_w [dim] f32; rope = inv_freq [rd/2] or a
    rope_norm.rope_table (the compressed layers' RoPE); kind 'kv' (fp8 simulation of the nope
    dims) or 'index' (Hadamard + fp4). ape [ratio, W2] f32, if given, is added here
    (score_row = wgate.x then; the same fp32 add as the torch code). Updates the pools and entries
    in place."""
    assert kind in ("kv", "index"), kind
    assert kv_row.dim() == 2 and kv_row.shape == score_row.shape, (kv_row.shape, score_row.shape)
    B, W2 = kv_row.shape
    coff = 2 if overlap else 1
    dim = entries.shape[2]
    rows = coff * ratio
    assert W2 == coff * dim, (W2, dim, overlap)
    assert kv_pool.shape == score_pool.shape and kv_pool.shape[1:] == (rows, W2), (kv_pool.shape, rows, W2)
    for t in (kv_row, score_row, kv_pool, score_pool):
        assert t.dtype == torch.float32 and t.stride(-1) == 1, (t.dtype, t.stride())
    assert entries.dim() == 3 and entries.dtype in (torch.bfloat16, torch.float32) and entries.stride(2) == 1
    assert slots.shape == (B,) and pos.shape == (B,) and slots.dtype == pos.dtype == torch.int64
    assert norm_w.shape == (dim,) and norm_w.dtype == torch.float32 and norm_w.is_contiguous()
    assert dim >= 4 and dim & (dim - 1) == 0, "dim must be a power of two"
    assert ratio >= 1 and rows & (rows - 1) == 0, "pooled rows must be a power of two"
    rp, table = _rn._rope_arg(rope, dim)
    if ape is not None:
        assert ape.shape == (ratio, W2) and ape.dtype == torch.float32 and ape.is_contiguous(), (ape.shape, ape.dtype)
        assert ape.device == kv_row.device
    assert kv_row.device == kv_pool.device == entries.device == slots.device == pos.device == norm_w.device == rope.device
    cfg = config or pick_config(ratio, overlap, dim)
    bc = cfg.block_c
    assert bc >= 1 and bc & (bc - 1) == 0 and dim % bc == 0, (bc, dim)
    if B == 0:
        return
    ncb = dim // bc
    dev = kv_row.device
    ews = torch.empty(B, dim, dtype=torch.float32, device=dev)
    cnt = workspace(dev, "counters_compressor", max(B, _COUNTERS), torch.int32) if ncb > 1 else ews
    grid = (ncb, B)
    _compressor_kernel[grid](
        kv_row, score_row, score_row if ape is None else ape, kv_pool, score_pool, entries, slots, pos, norm_w,
        rope, ews, cnt,
        kv_row.stride(0), score_row.stride(0), kv_pool.stride(0), kv_pool.stride(1), score_pool.stride(0),
        score_pool.stride(1), entries.stride(0), entries.stride(1), float(eps),
        DIM=dim, R=ratio, OVERLAP=overlap, ROWS=rows, BC=bc, NCB=ncb, HALF=dim // 2,
        LOG_HALF=(dim // 2).bit_length() - 1, NOPE_P=dim // 2 - rp, ROPE_P=rp, INDEX=kind == "index",
        HAS_APE=ape is not None, TABLE=table,
        OUT_BF16=entries.dtype == torch.bfloat16, INTERPRET=on_interpreter(kv_row), num_warps=cfg.num_warps,
        **_rn.TORCH_MATH, **launch_opts(kv_row, grid),
    )


def compressor_step_ref(kv_row, score_row, kv_pool, score_pool, entries, slots, pos, norm_w, rope, ratio, overlap,
                        kind, eps, ape=None, config=None) -> None:
    """FastDecoder._compress from the row store on (its code, with the pools as arguments)."""
    del config
    kvp, scp, ent, r, dim = kv_pool, score_pool, entries, ratio, entries.shape[2]
    kv, sc = kv_row, (score_row if ape is None else score_row + ape[pos % r])
    row = (r if overlap else 0) + pos % r
    kvp[slots, row] = kv
    scp[slots, row] = sc
    st_kv, st_sc = kvp[slots], scp[slots]  # [B, rows, width]
    if overlap:
        kvs = torch.cat([st_kv[:, :r, :dim], st_kv[:, r:, dim:]], 1)
        scs = torch.cat([st_sc[:, :r, :dim], st_sc[:, r:, dim:]], 1)
    else:
        kvs, scs = st_kv, st_sc
    emit = (pos + 1) % r == 0
    e = (kvs * torch.softmax(scs, dim=1)).sum(1)
    e = torch.where(emit[:, None], e, 0.0)  # rows whose window is open may hold -inf scores
    e = ops.rms_norm(e.to(ent.dtype), norm_w, eps)
    epos = pos + 1 - r
    e = _rn.apply_rope_ref(e, rope, epos.clamp_min(0) if rope.dim() == 2 else epos)  # (clamp: discarded rows)
    rd = 2 * (rope.numel() if rope.dim() == 1 else rope.shape[1] // 2)
    e = ops.index_sim(e) if kind == "index" else ops.kv_sim(e, dim - rd)
    discard = ent.shape[1] - 1
    ent[slots, torch.where(emit, (pos + 1) // r - 1, discard)] = e
    if overlap:  # the closed window becomes the previous one
        keep = emit[:, None, None]
        kvp[slots, :r] = torch.where(keep, st_kv[:, r:], st_kv[:, :r])
        scp[slots, :r] = torch.where(keep, st_sc[:, r:], st_sc[:, :r])
