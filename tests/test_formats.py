"""Number formats (MODEL_SPEC §2.1, §3, §9.1 tier 1): FP8 e4m3 + E8M0 block scales, MXFP4 nibble
order and e2m1 rounding, the activation-quantization simulations, the Hadamard rotation."""

import itertools

import pytest
import torch

from megastep.checkpoint import formats as F


def e2m1_from_bits(code: int) -> float:
    """Independent decode of an e2m1 code from its bit fields (1 sign, 2 exponent, 1 mantissa)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def test_e2m1_table_matches_bit_fields():
    assert [e2m1_from_bits(c) for c in range(16)] == list(F.E2M1_VALUES)
    codes = torch.arange(16, dtype=torch.uint8)
    assert F.e2m1_to_float(codes).tolist() == list(F.E2M1_VALUES)


def test_e2m1_rounding_nearest_even_and_saturating():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # exact grid points and their negatives survive
    x = torch.tensor(grid + [-g for g in grid[1:]])
    assert torch.equal(F.round_e2m1(x), x)
    # midpoints go to the neighbour with the even code (mantissa bit 0)
    mids = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    got = F.round_e2m1(torch.tensor(list(mids)))
    assert got.tolist() == list(mids.values())
    assert F.round_e2m1(torch.tensor([-0.75, -5.0])).tolist() == [-1.0, -4.0]
    # off-midpoint values go to the nearest grid point; beyond 6 saturates
    x = torch.linspace(-8, 8, 1601)
    g = torch.tensor(grid + [-v for v in grid[1:]])
    nearest_dist = (x[:, None] - g[None]).abs().min(1).values
    assert torch.allclose((F.round_e2m1(x) - x).abs().clamp(max=10), nearest_dist.where(x.abs() <= 6, (x.abs() - 6)))


def test_fp4_nibble_order_low_nibble_is_first_element():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)  # .5, 1, 1.5, -6
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0xF3]]
    assert torch.equal(F.unpack_fp4(packed), codes)
    # the layout torch names float4_e2m1fn_x2 is the same bytes
    assert packed.view(torch.float4_e2m1fn_x2).view(torch.uint8).tolist() == [[0x21, 0xF3]]


def test_e8m0_matches_torch_dtype():
    raw = torch.arange(0, 255, dtype=torch.uint8)
    ours = F.e8m0_to_float(raw.view(torch.float8_e8m0fnu))
    theirs = raw.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours, theirs)
    pows = torch.ldexp(torch.ones(20), torch.arange(-10, 10))
    assert torch.equal(F.float_to_e8m0(pows).float(), pows)
    with pytest.raises(ValueError):
        F.float_to_e8m0(torch.tensor([3.0]))


def test_pow2_scale_is_exact_ceil():
    amax = torch.tensor([448.0, 449.0, 1.0, 896.0, 1e-4, 3.0e5])
    s = F.pow2_scale(amax, F.FP8_MAX)
    # smallest power of two with amax / s <= 448
    for a, v in zip(amax.tolist(), s.tolist()):
        assert a / v <= 448.0 and a / (v / 2) > 448.0
        assert v == 2.0 ** round(torch.log2(torch.tensor(v)).item())


@pytest.mark.parametrize("shape,block", [((256, 384), 128), ((300, 200), 128), ((33, 65), 32), ((7, 5), 32)])
def test_fp8_weight_round_trip(shape, block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * 3
    q, s = F.quantize_fp8_weight(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (-(-shape[0] // block), -(-shape[1] // block))
    d = F.dequantize_fp8_weight(q, s, block)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the element, plus the block's
    # subnormal floor.
    assert torch.all((d - w).abs() <= w.abs() * 2**-4 + 2.0**-6 * F.e8m0_to_float(s).max())
    # quantizing an already-quantized weight reproduces it exactly
    q2, s2 = F.quantize_fp8_weight(d, block)
    assert torch.equal(F.dequantize_fp8_weight(q2, s2, block), d)
    # payload agrees with torch's own e4m3 cast of the scaled block
    sc = F.e8m0_to_float(s).repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]
    assert torch.equal(q.view(torch.uint8), (w / sc).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_mxfp4_weight_round_trip_and_layout():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 96, generator=g)
    packed, s = F.quantize_mxfp4_weight(w)
    assert packed.dtype == torch.int8 and packed.shape == (16, 48)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (16, 3)
    d = F.dequantize_mxfp4_weight(packed, s)
    sc = F.e8m0_to_float(s).repeat_interleave(32, 1)
    assert torch.all((w / sc).abs().amax() <= 6.0)
    assert torch.equal(d, F.round_e2m1(w / sc) * sc)
    # element 2j is the low nibble of byte j
    codes = F.e2m1_codes(w / sc)
    assert torch.equal(packed.view(torch.uint8) & 0xF, codes[:, 0::2])
    assert torch.equal(packed.view(torch.uint8) >> 4, codes[:, 1::2])
    with pytest.raises(ValueError):
        F.quantize_mxfp4_weight(torch.randn(4, 40))


@pytest.mark.parametrize("block", [32, 64, 128])
def test_fp8_act_sim_matches_real_quantization(block):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4 * block, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    sim = F.fp8_act_sim(x, block)
    q, s = F.fp8_act_quant(x, block)
    assert torch.equal(sim, (q.float().unflatten(-1, (-1, block)) * s[..., None]).flatten(-2))
    # a bf16 input stays bf16 and is exactly representable
    xb = x.bfloat16()
    assert F.fp8_act_sim(xb, block).dtype == torch.bfloat16
    # scales are powers of two and amax lands at most at 448
    assert torch.all(torch.frexp(s)[0] == 0.5)
    assert torch.all(q.float().abs() <= 448)


def test_fp8_act_sim_tiny_amax_floor_and_ragged_block():
    x = torch.zeros(1, 70)
    x[0, 3] = 1e-9  # below the 1e-4 amax floor: scale 2^ceil(log2(1e-4/448)) = 2^-22
    want = torch.zeros(1, 70)
    want[0, 3] = 2.0**-30  # 1e-9 * 2^22 = 0.0042 rounds to the e4m3 subnormal 2 * 2^-9
    assert torch.equal(F.fp8_act_sim(x, 64), want)
    y = torch.randn(2, 70)
    out = F.fp8_act_sim(y, 64)
    assert out.shape == y.shape
    assert torch.equal(out[:, 64:], F.fp8_act_sim(y[:, 64:], 64))  # ragged block uses its own amax


def test_fp4_act_sim_values_on_grid():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    y = F.fp4_act_sim(x, 32)
    b = x.unflatten(-1, (-1, 32))
    s = F.pow2_scale(b.abs().amax(-1, keepdim=True), F.FP4_MAX)
    assert torch.equal(y, (F.round_e2m1(b / s) * s).flatten(-2))
    vals = set((y.unflatten(-1, (-1, 32)) / s).abs().flatten().tolist())
    assert vals <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_hadamard_is_orthonormal_and_sylvester():
    for n in (1, 2, 16, 128):
        h = F.hadamard_matrix(n)
        assert torch.equal(h @ h.T, n * torch.eye(n))
    h4 = F.hadamard_matrix(4)
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    x = torch.randn(3, 128)
    y = F.hadamard_rotate(x)
    assert torch.allclose(F.hadamard_rotate(y), x, atol=1e-5)  # H/sqrt(n) is its own inverse
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    with pytest.raises(ValueError):
        F.hadamard_matrix(12)


def test_e4m3_rounding_is_nearest_even():
    # between 1 and 1.125 (e4m3 step 1/8 at exponent 0), the midpoint 1.0625 goes to even 1.0
    assert F.round_e4m3(torch.tensor([1.0625, 1.1875, 500.0, -500.0])).tolist() == [1.0, 1.25, 448.0, -448.0]
    for a, b in itertools.pairwise([0.0, 0.001953125, 0.00390625]):  # subnormals
        assert F.round_e4m3(torch.tensor([a])).item() == a and F.round_e4m3(torch.tensor([b])).item() == b
