"""The in-kernel number-format helpers against formats.py, value by value (exact)."""

import pytest
import torch
import triton
import triton.language as tl

from megastep.checkpoint import formats as F
from megastep.kernels.common import e8m0_to_f32, fp8_pow2_scale, fp8_round, mxfp4_decode, on_interpreter, round_bf16

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _helpers_kernel(a_ptr, s_ptr, inv_ptr, v_ptr, r_ptr, b_ptr, bf_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):
    o = tl.arange(0, N)
    a = tl.load(a_ptr + o)
    s, inv = fp8_pow2_scale(a)
    tl.store(s_ptr + o, s)
    tl.store(inv_ptr + o, inv)
    tl.store(r_ptr + o, fp8_round(tl.load(v_ptr + o), 1.0, INTERPRET).to(tl.float32))
    tl.store(b_ptr + o, e8m0_to_f32((o % 256).to(tl.uint8)))
    tl.store(bf_ptr + o, round_bf16(tl.load(v_ptr + o) * 1.001, INTERPRET))


def test_fp8_scale_round_e8m0_bf16_helpers():
    n = 1 << 14
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(n, generator=g) * 2000
    # exact powers of two times 448, their neighbours, and values under the 1e-4 floor
    edge = torch.tensor([448.0, 896.0, 224.0, 1e-4, 1e-6, 0.0, 1.0, 3.0e5])
    amax[: edge.numel()] = edge
    amax[8:40] = torch.ldexp(torch.full((32,), 448.0), torch.arange(-16, 16))
    amax[40:72] = torch.nextafter(amax[8:40], torch.full((32,), 1e9))
    amax[72:104] = torch.nextafter(amax[8:40], torch.zeros(32))
    e4 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[e4.isfinite()]
    srt = e4.unique().sort().values
    v = torch.cat([e4, (srt[1:] + srt[:-1]) / 2, torch.randn(n, generator=g) * 100, torch.randn(n, generator=g) * 0.01])
    v = v[:n].clamp(-448, 448)
    s, inv, r, b, bf = (torch.empty(n, device=DEV) for _ in range(5))
    _helpers_kernel[(1,)](amax.to(DEV), s, inv, v.to(DEV), r, b, bf, N=n, INTERPRET=on_interpreter(s))
    want = F.pow2_scale(amax.clamp_min(1e-4), F.FP8_MAX)
    assert torch.equal(s.cpu(), want)
    assert torch.equal(inv.cpu(), 1.0 / want)
    assert torch.equal(r.cpu(), F.round_e4m3(v))  # every e4m3 value and every midpoint (ties to even)
    assert torch.equal(b.cpu(), F.e8m0_to_float((torch.arange(n) % 256).to(torch.uint8)))  # incl. 0 -> 2^-127
    assert torch.equal(bf.cpu(), (v * 1.001).bfloat16().float())


@triton.jit
def _decode_kernel(b_ptr, sc_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    ev, od = mxfp4_decode(tl.load(b_ptr + o), tl.load(sc_ptr + o))
    tl.store(out_ptr + 2 * o, ev)
    tl.store(out_ptr + 2 * o + 1, od)


@pytest.mark.parametrize("scale_bytes", [(127,), (100, 120, 127, 130, 150), (2, 200, 240)])
def test_mxfp4_decode_every_byte_exact(scale_bytes):
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scale_bytes))
    sc = torch.tensor(scale_bytes, dtype=torch.uint8).repeat_interleave(256)
    n = packed.numel()
    n2 = triton.next_power_of_2(n)
    bp = torch.zeros(n2, dtype=torch.uint8)
    sp = torch.full((n2,), 127, dtype=torch.uint8)
    bp[:n], sp[:n] = packed, sc
    out = torch.empty(2 * n2, device=DEV)
    _decode_kernel[(1,)](bp.to(DEV), sp.to(DEV), out, N=n2)
    # formats.py: [rows, 16 bytes] with one scale per 32 elements = per row here
    want = F.dequantize_mxfp4_weight(packed.view(torch.int8).view(-1, 16), sc.view(-1, 16)[:, 0:1].view(torch.float8_e8m0fnu))
    assert torch.equal(out.cpu()[: 2 * n], want.flatten())
