"""Pieces shared by the fused kernels: in-kernel activation quantization (the exact twin of
`formats.fp8_act_sim`), MXFP4 decoding in registers, and the split-reduction workspace.

Numerics that every kernel relies on (and the tests pin):
- The activation scale 2^ceil(log2(max(amax, 1e-4) / 448)) is computed from the bits of amax,
  without a division: amax = 1.f * 2^e and 448 = 1.75 * 2^8, so the scale is 2^(e-8) when
  1.f <= 1.75 and 2^(e-7) otherwise. This equals `formats.pow2_scale`, which rounds amax/448 to
  fp32 first: the quotient is at least 18 ulps away from a power of two unless amax is exactly
  448 * 2^k, so the rounding never moves it across one.
- x / s and q * s are exact (powers of two), so a kernel may fold activation and weight scales
  into either operand before a product: e4m3 * 2^a * e4m3 * 2^b and e2m1 * 2^a * e4m3 * 2^b are
  exact in fp32 (and their factors exact in bf16); only the order of the fp32 sums differs from
  the `*_ref` functions.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

FP8_ACT_BLOCK = 128  # channels per activation-quantization block along K (V4)


def on_interpreter(t: torch.Tensor) -> bool:
    """Kernels launched on CPU tensors run under the Triton interpreter (TRITON_INTERPRET=1).

    The interpreter computes a bf16 `tl.dot` wrongly, so kernels that feed tensor cores with bf16
    operands take fp32 operands there (same values: every operand is exact in bf16)."""
    return t.device.type != "cuda"


# ---- programmatic dependent launch (PDL) ------------------------------------------------
# Hopper's griddepcontrol lets a kernel's CTAs be placed on SMs while the previous kernel on the
# stream (or in the CUDA graph) still drains, hiding the launch gap between short decode kernels.
# Every launched kernel takes `PDL: tl.constexpr`, enters through `pdl_enter(PDL)` before touching
# global memory, and its launch passes `**launch_opts(tensor, grid)`. Off by default; the switch
# is read at launch (and so at graph capture): a captured graph keeps the setting it was captured
# with. When the next kernel may be placed (its "release") depends on the grid:
# - PDL_EARLY (a grid of at most one program per SM): at entry. The next kernel's CTAs take free
#   SM slots at once and wait there; this grid needs no more slots than it already has.
# - PDL_LATE (a larger grid): where the kernel calls `pdl_release(PDL)`, after its main loop
#   (the weight streams, attention's KV loop), or at exit. Placed early, the next kernel's
#   waiting CTAs would hold slots that this grid's later programs need (the first PDL
#   measurement, 2026-11-29: every batch slower).
# - PDL_PLAIN (an FP8 linear streaming more than PLAIN_PLACEMENT_BYTES of weights): launched
#   without the attribute, so it is placed once its predecessor has completed, on empty SMs, and
#   its CTAs spread over the SMs as a plain launch's do; it still releases its dependents after
#   its main loop, so the next kernel is placed early. Why: under PDL the FP8 linear streamed at
#   2.62 TB/s against 3.04 without it (docs/PERFORMANCE.md, eighth measurement). Measured in the
#   30-layer step on one H200 (seventeenth measurement), A/B/A/B, p50 ms at 1 / 2 / 4 rows: all
#   placed early 4.977 / 6.130 / 8.068 and 4.978 / 6.121 / 8.082; above 16 MiB (the qr group, wo_a,
#   wo_b) 4.779 / 5.974 / 7.956 and 4.760 / 5.974 / 7.955; above 4 MiB (also the x group and the
#   shared expert's) 4.885 / 5.953 / 7.990 and 4.882 / 5.945 / 7.996. In a second call, above
#   12 MiB (16 MiB's and the shared expert's w1/w3) 4.768 / 5.960 / 8.000 and 4.760 / 5.967 / 7.987
#   against 16 MiB's 4.764 / 6.027 / 7.999 and 4.761 / 6.019 / 8.004: the default. In the 1-row
#   timeline wo_a and wo_b close 14.9 and 15.9 us of a layer against 18.8 and 17.6. A reading not
#   yet checked: CTAs placed into the slots a draining predecessor frees land unevenly over the
#   SMs, and the SMs holding the most set the pace. (The experts' gate-up placed plainly was slower:
#   1 row +0.29 ms, 2 rows +0.5; it keeps its early placement.)
# A weight-streaming kernel asks L2 for its first weight lines before it waits
# (`l2_prefetch_rows`): weights never depend on the predecessor, so that DRAM latency overlaps
# the predecessor's tail (its split-K combine). Only the first lines: prefetching whole weight
# tiles with evict_last halved the streaming rate (docs/PERFORMANCE.md, seventh measurement).
_PDL = False
PDL_OFF, PDL_LATE, PDL_EARLY, PDL_PLAIN = 0, 1, 2, 3
PLAIN_PLACEMENT_BYTES: int | None = 12 << 20  # None: every kernel placed early (PDL_PLAIN never taken)
PREFETCH_BYTES = 512  # per weight row and program: the first 4 steps of an FP8 linear
_SMS: dict[int, int] = {}


def set_pdl(enabled: bool) -> bool:
    """Turn PDL on or off for every later kernel launch in this process; returns the old value."""
    global _PDL
    old, _PDL = _PDL, bool(enabled)
    return old


def pdl_enabled() -> bool:
    return _PDL


def sm_count(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def launch_opts(t: torch.Tensor, grid: tuple[int, ...], stream_bytes: int = 0) -> dict:
    """Launch keywords for a kernel whose inputs live where `t` lives and whose grid is `grid`:
    the kernel's `PDL` constexpr (PDL_OFF, PDL_LATE, PDL_EARLY or PDL_PLAIN) and Triton's
    `launch_pdl`. stream_bytes: the weight bytes the launch streams (PDL_PLAIN above
    PLAIN_PLACEMENT_BYTES). Always off under the interpreter, where the gdc_* instructions raise."""
    if not _PDL or on_interpreter(t):
        return {"PDL": PDL_OFF, "launch_pdl": False}
    if PLAIN_PLACEMENT_BYTES is not None and stream_bytes > PLAIN_PLACEMENT_BYTES:
        return {"PDL": PDL_PLAIN, "launch_pdl": False}
    programs = 1
    for g in grid:
        programs *= g
    return {"PDL": PDL_EARLY if programs <= sm_count(t.device) else PDL_LATE, "launch_pdl": True}


def prefetch_lines(opts: dict, k_bytes: int) -> int:
    """LINES of `l2_prefetch_rows` for a program that streams `k_bytes` bytes of each weight row,
    under the launch options `opts`: the first PREFETCH_BYTES of the row when placed early, else 0."""
    if not opts["launch_pdl"]:
        return 0
    return next_pow2(-(-min(k_bytes, PREFETCH_BYTES) // 128))


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Every launched kernel's entry, before any global load, store or atomic (only a weight
    prefetch may precede it).

    gdc_wait blocks until the predecessor grid has completed and its writes are visible; the
    predecessor may still be writing what we read or reading what we overwrite. The guarantee is
    transitive: the predecessor itself completed only after its own predecessor did. A
    predecessor that never releases (a torch op) lets this kernel start only once it completes,
    as without PDL. PDL_EARLY releases the next kernel first (see above). PDL_PLAIN was placed after
    its predecessor completed: nothing to wait for."""
    if PDL == 2:  # PDL_EARLY
        tlc.gdc_launch_dependents()
    if PDL == 1 or PDL == 2:
        tlc.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """A PDL_LATE kernel's release point, after its main loop: the next kernel's CTAs may be
    placed (they wait in pdl_enter until this grid completes). No-op otherwise."""
    if PDL == 1 or PDL == 3:  # PDL_LATE, PDL_PLAIN
        tlc.gdc_launch_dependents()


@triton.jit
def l2_prefetch_rows(w_ptr, n0, N, stride_wn, pid_k, K_PER_SPLIT, K, ROWS: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 (plain prefetch, no eviction hint) for the first LINES 128-byte lines of split pid_k's
    elements [pid_k * K_PER_SPLIT, min(that + K_PER_SPLIT, K)) of weight rows [n0, n0 + ROWS) (rows
    past N: the last one; lines past the split: its first one again). Before `pdl_enter` only:
    weights never depend on the predecessor."""
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    rows = w_ptr + tl.minimum(n0 + tl.arange(0, ROWS), N - 1).to(tl.int64)[:, None] * stride_wn
    PER_LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    k = k_lo + tl.arange(0, LINES) * PER_LINE
    k = tl.where(k < k_hi, k, k_lo)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [(rows + k[None, :]).to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def f32_order_key(x):
    """fp32 -> uint32 keys in the order of the values, -0.0 counted as +0.0 (-inf: 0x007FFFFF, so
    0 stays below every number; NaN is left where its bits fall: callers that meet NaN place it).
    (u ^ 0xFFFFFFFF is ~u: the uint32 literal keeps the type, and Triton 3.8's interpreter fails on
    ~ of an unsigned tensor with numpy 2, filling its all-ones value from -1.)"""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def fp8_pow2_scale(amax):
    """amax (fp32, any shape) -> (s, 1/s) with s = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    amax = tl.maximum(amax, 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    se = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # biased exponent of s
    s = (se << 23).to(tl.float32, bitcast=True)
    inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def f16_pow2_scale(amax):
    """amax (fp32, any shape) -> (s, 1/s) with s = 2^(floor(log2(max(amax, 2^-64))) - 14): x / s
    lies in fp16's range (|x / s| < 2^15) and a bf16 x is exact there down to |x| ~ amax * 2^-31
    (fp16 subnormals keep 8 significant bits from 2^-17 on); both multiplications are exact."""
    amax = tl.maximum(amax, 5.421010862427522e-20)  # 2^-64
    se = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 14  # biased exponent of s
    s = (se << 23).to(tl.float32, bitcast=True)
    inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def fp8_block_scales(ax, offs, SUB: tl.constexpr, NSUB: tl.constexpr):
    """Per-element activation scales for a tile of |x| [R, C] whose columns fall into NSUB
    quantization blocks: column c belongs to block offs[c] // SUB (offs relative to the first
    block). Returns (s, 1/s) broadcast to [R, C]."""
    if NSUB == 1:
        s, inv = fp8_pow2_scale(tl.max(ax, axis=1))
        s_el = tl.broadcast_to(s[:, None], ax.shape)
        inv_el = tl.broadcast_to(inv[:, None], ax.shape)
    else:
        blk = offs // SUB
        s_el = tl.zeros(ax.shape, dtype=tl.float32)
        inv_el = tl.zeros(ax.shape, dtype=tl.float32)
        for b in tl.static_range(NSUB):
            inb = (blk == b)[None, :]
            s, inv = fp8_pow2_scale(tl.max(tl.where(inb, ax, 0.0), axis=1))
            s_el = tl.where(inb, s[:, None], s_el)
            inv_el = tl.where(inb, inv[:, None], inv_el)
    return s_el, inv_el


@triton.jit
def fp8_round(x, inv, INTERPRET: tl.constexpr):
    """x * inv rounded to e4m3 (round to nearest even; |x * inv| <= 448 by construction).

    On the GPU a cast (cvt.rn.satfinite, so no clamp is needed or paid for). The Triton
    interpreter's fp32 -> e4m3 cast mishandles a rounding carry into the next binade (31.65 ->
    16), so there the value is first clamped and rounded to the e4m3 grid in fp32 arithmetic (the
    cast of an exact value is then right)."""
    v = x * inv
    if INTERPRET:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        bits = v.to(tl.int32, bitcast=True)
        # normal e4m3: keep 3 of 23 mantissa bits, ties to even, carry into the exponent
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
        normal = bits.to(tl.float32, bitcast=True)
        # subnormal e4m3 (|v| < 2^-6): multiples of 2^-9, ties to even, by adding 1.5 * 2^14
        # (whose fp32 ulp is 2^-9 on both sides)
        sub = (v + 24576.0) - 24576.0
        v = tl.where(tl.abs(v) < 0.015625, sub, normal)
    return v.to(tl.float8e4nv)


@triton.jit
def store_fp8_codes(y, offs, m, n, codes_ptr, scales_ptr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """The activation quantization of a row, done once where the row is made: y [BLOCK] fp32
    (the values a linear will read, already rounded to their dtype), offs = arange(BLOCK) (the
    row's channels), m = offs < n -> e4m3 codes at codes_ptr[offs] and the per-128-block scales
    at scales_ptr[0 .. cdiv(n, 128)), exactly `formats.fp8_act_quant` (a ragged last block on its
    own amax). BLOCK is a multiple of 128. linear_fp8 (x_codes=) then skips its own quantization."""
    NB: tl.constexpr = BLOCK // 128
    y2 = tl.reshape(y, [NB, 128])
    s, inv = fp8_pow2_scale(tl.max(tl.abs(y2), axis=1))
    tl.store(codes_ptr + tl.reshape(offs, [NB, 128]), fp8_round(y2, inv[:, None], INTERPRET),
             mask=tl.reshape(m, [NB, 128]))
    nb = tl.arange(0, NB)
    tl.store(scales_ptr + nb, s, mask=nb * 128 < n)


@triton.jit
def round_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32.

    The interpreter's fp32 -> bf16 cast truncates, so there the rounding is done on the bits."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def e8m0_to_f32(b):
    """E8M0 bytes (uint8 tensor) -> fp32 2^(b-127); byte 0 gives the subnormal 2^-127 as torch."""
    bi = b.to(tl.int32)
    return tl.where(bi == 0, 2.0**-127, (bi << 23).to(tl.float32, bitcast=True))


@triton.jit
def mxfp4_decode(b, sc):
    """Packed MXFP4 bytes b (uint8) and their E8M0 scale bytes sc (uint8, same shape) ->
    (even, odd) fp32 values. The low nibble is the even element.

    Each nibble s.e.e.m is moved into an fp16 bit pattern as sign bit 15, exponent/mantissa
    bits 11..9: that fp16 is exactly e2m1 * 2^-14 (code 1 lands on the fp16 subnormal 2^-15),
    so one multiply by 2^(scale - 127 + 14) gives the exact MXFP4 value."""
    bi = b.to(tl.int32)
    lo = ((bi << 12) & 0x8000) | ((bi << 9) & 0x0E00)
    hi = ((bi << 8) & 0x8000) | ((bi << 5) & 0x0E00)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    f = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return lo * f, hi * f


@triton.jit
def mxfp4_decode_unscaled(b):
    """Packed MXFP4 bytes (uint8) -> (even, odd) fp32 e2m1 values times 2^-14 (see mxfp4_decode);
    the caller multiplies a sum over a 32-group by that group's 2^(scale - 127 + 14)."""
    bi = b.to(tl.int32)
    lo = ((bi << 12) & 0x8000) | ((bi << 9) & 0x0E00)
    hi = ((bi << 8) & 0x8000) | ((bi << 5) & 0x0E00)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# ---- split-reduction workspace ----------------------------------------------------------
# Kernels that split a reduction over several programs write fp32 partials and count arrivals
# in int32 counters; the last program to arrive sums the partials in a fixed order and resets
# its counter to 0, so the counters stay zero between launches (and across CUDA-graph replays).
# One workspace per device and lane: kernels of one lane run one after the other (one stream);
# a caller that launches on a second stream concurrently does so inside `lane(name)`, which
# gives those launches their own buffers.
_WORKSPACES: dict[tuple[str, str, str], torch.Tensor] = {}
# Buffers replaced by larger ones stay alive: a CUDA graph captured earlier still points at them.
_RETIRED: list[torch.Tensor] = []
_LANE = ""


@contextlib.contextmanager
def lane(name: str):
    """Workspaces requested inside this block are the lane `name`'s own (see above)."""
    global _LANE
    old, _LANE = _LANE, name
    try:
        yield
    finally:
        _LANE = old


def workspace(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached buffer of at least `numel` elements for the current lane; "counters" buffers
    start zeroed."""
    key = (str(device), kind, _LANE)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(numel, 1024)
        buf = torch.zeros(n, dtype=dtype, device=device) if kind.startswith("counters") else torch.empty(n, dtype=dtype, device=device)
        _WORKSPACES[key] = buf
    return buf


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
