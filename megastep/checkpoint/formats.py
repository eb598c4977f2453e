"""Number formats of the official DeepSeek-V4 checkpoints, and the activation-quantization
simulations of the official inference code (MODEL_SPEC §2.1, §3).

- FP8 weights: float8_e4m3fn payload [N, K] + E8M0 block scale [ceil(N/B), ceil(K/B)].
- MXFP4 experts: int8 [N, K/2], two e2m1 codes per byte, the LOW nibble holding the even
  (first) element; E8M0 scale [N, K/32], one per 32 along K.
- E8M0: one byte, value 2^(byte - 127) (torch.float8_e8m0fnu).

Scales are powers of two chosen as 2^ceil(log2(amax / qmax)). They are computed with
`torch.frexp`, not `log2`, so they are exact and identical on every device.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
MX_BLOCK = 32  # elements of K per MXFP4 scale

# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---- E8M0 -------------------------------------------------------------------------------
def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu or their raw uint8 bytes) -> float32 powers of two."""
    u = s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s.to(torch.uint8)
    return torch.ldexp(torch.ones_like(u, dtype=torch.float32), u.to(torch.int32) - 127)


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (float32) -> float8_e8m0fnu."""
    m, e = torch.frexp(s.float())
    if not bool((m == 0.5).all()):
        raise ValueError("E8M0 holds only powers of two")
    return (e - 1 + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax / qmax)), exactly, for positive finite amax (float32)."""
    m, e = torch.frexp(amax.float() / qmax)  # amax/qmax = m * 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)  # an exact power of two keeps its own exponent
    return torch.ldexp(torch.ones_like(m), e)


# ---- element rounding -------------------------------------------------------------------
def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest e4m3fn value (ties to even), saturating at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8, 0..15), round to nearest with ties to even, saturating.

    The grid is {0, .5, 1, 1.5, 2, 3, 4, 6}; a tie goes to the code with an even mantissa bit,
    so midpoints .25, 1.25, 2.5, 5 round down and .75, 1.75, 3.5 round up.
    """
    a = x.float().abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    sign = (x.float() < 0) | ((x.float() == 0) & torch.signbit(x.float()))
    return code | (sign.to(torch.uint8) << 3)


_E2M1_LUT: dict[str, torch.Tensor] = {}


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    # the table is built once per device: a host-to-device copy cannot happen in a CUDA graph
    key = str(codes.device)
    if key not in _E2M1_LUT:
        _E2M1_LUT[key] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return _E2M1_LUT[key][codes.long()]


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    return e2m1_to_float(e2m1_codes(x))


# ---- FP4 packing ------------------------------------------------------------------------
def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] (K even) -> int8 [..., K/2]; low nibble = even element."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., K/2] -> e2m1 codes uint8 [..., K]."""
    u = packed.view(torch.uint8)
    return torch.stack([u & 0x0F, u >> 4], dim=-1).flatten(-2)


# ---- weights ----------------------------------------------------------------------------
def _blocks2d(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """Pad [N, K] to multiples of block and view as [nb, block, kb, block]."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    p = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    p[:n, :k] = w.float()
    return p.view(nb, block, kb, block), n, k


def quantize_fp8_weight(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float8_e8m0fnu [ceil(N/B), ceil(K/B)])."""
    b, n, k = _blocks2d(w, block)
    amax = b.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = pow2_scale(amax, FP8_MAX)
    q = (b / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(b.shape[0] * block, -1)[:n, :k].contiguous(), float_to_e8m0(s)


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """(e4m3 [N, K], e8m0 or float32 scale [ceil(N/B), ceil(K/B)]) -> float32 [N, K]."""
    n, k = q.shape
    s = e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * s


def quantize_mxfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] (K % 32 == 0) -> (int8 [N, K/2], float8_e8m0fnu [N, K/32])."""
    n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K divisible by {MX_BLOCK}, got {k}")
    b = w.float().view(n, k // MX_BLOCK, MX_BLOCK)
    s = pow2_scale(b.abs().amax(-1).clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    codes = e2m1_codes(b / s[..., None]).view(n, k)
    return pack_fp4(codes), float_to_e8m0(s)


def dequantize_mxfp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(int8 [N, K/2], e8m0 [N, K/32]) -> float32 [N, K]."""
    v = e2m1_to_float(unpack_fp4(packed))
    return v * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, -1)


# ---- activation-quantization simulations (quantize -> dequantize, as in QAT) ------------
def _act_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    k = x.shape[-1]
    pad = (-k) % block
    xf = x.float()
    if pad:  # a ragged last block (tiny test shapes) is quantized on its own amax
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.unflatten(-1, (-1, block)), k


def fp8_act_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp8q(x, B): per block s = 2^ceil(log2(max(amax, 1e-4)/448)); x <- e4m3(x/s)*s."""
    b, k = _act_blocks(x, block)
    s = pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(1e-4), FP8_MAX)
    return (round_e4m3(b / s) * s).flatten(-2)[..., :k].to(x.dtype)


def fp4_act_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp4q(x, B): per block s = 2^ceil(log2(max(amax, 6*2^-126)/6)); x <- e2m1(x/s)*s."""
    b, k = _act_blocks(x, block)
    s = pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    return (round_e2m1(b / s) * s).flatten(-2)[..., :k].to(x.dtype)


def fp8_act_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % block == 0) -> (e4m3 [..., K], float32 pow2 scales [..., K/block]).

    The real-quantization twin of `fp8_act_sim`: q.float() * s == fp8_act_sim(x) exactly.
    """
    b = x.float().unflatten(-1, (-1, block))
    s = pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(1e-4), FP8_MAX)
    q = (b / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester Hadamard matrix [n, n] (float32, entries +-1), n a power of two."""
    key = (n, str(device))
    if key not in _HADAMARD:
        if n & (n - 1):
            raise ValueError(f"Hadamard size must be a power of two, got {n}")
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = h.to(device)
    return _HADAMARD[key]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform along the last dim (fp32 math, input dtype out)."""
    n = x.shape[-1]
    return ((x.float() @ hadamard_matrix(n, x.device)) * n**-0.5).to(x.dtype)
