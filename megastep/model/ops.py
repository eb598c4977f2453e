"""The decode math of DeepSeek-V4 as plain-torch primitives over any leading batch dims
(MODEL_SPEC §3). The reference decode calls them with no batch dim, the batched decode step with
one row per sequence; both therefore round at exactly the same points."""

from __future__ import annotations

import math

import torch

from megastep.checkpoint import formats
from megastep.config import ModelConfig

KV_SIM_BLOCK = 64  # fp8 simulation block on the KV nope dims
INDEX_SIM_BLOCK = 32  # fp4 simulation block in the indexer


def rope_inv_freq(cfg: ModelConfig, compressed: bool) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2], fp32, computed as the official `precompute_freqs_cis`:
    theta 10000 without YaRN on sliding layers, compress_rope_theta with YaRN on compressed ones."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rs = cfg.rope_scaling
    if compressed and rs is not None:
        def corr(rot: float) -> float:
            return dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rs.beta_fast)), 0)
        high = min(math.ceil(corr(rs.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / rs.factor * ramp + freqs * (1 - ramp)
    return freqs


def apply_rope(x: torch.Tensor, inv_freq: torch.Tensor, pos: int | torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J interleaved RoPE on the trailing 2*len(inv_freq) dims of x (fp32 math).

    pos: an int, or a tensor [B] of positions for x [B, ...] (one position per row)."""
    rd = 2 * inv_freq.numel()
    if isinstance(pos, torch.Tensor):
        ang = pos.float().view(-1, *([1] * (x.dim() - 2)), 1) * inv_freq
    else:
        ang = torch.tensor(float(pos), dtype=torch.float32, device=inv_freq.device) * inv_freq
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    r = x[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if w is None else w * y).to(x.dtype)


def sinkhorn_mixes(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """Split mHC mixes [..., (2+hc)*hc] into pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """mixes = (fn . flat(h)) * rsqrt(mean(flat(h)^2) + eps), fp32; h [..., hc, D]."""
    xf = h.flatten(-2).float()
    return (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg: ModelConfig):
    """mHC pre: h [..., hc, D] -> (collapsed [..., D], post [..., hc], comb [..., hc, hc])."""
    pre, post, comb = sinkhorn_mixes(
        hc_mixes(h, fn, cfg.rms_norm_eps), scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
    )
    return (pre[..., None] * h.float()).sum(-2).to(h.dtype), post, comb


def hc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Output stream k = post[k] * y + sum_j comb[j, k] * h[j]; y [..., D], h [..., hc, D]."""
    out = post[..., None] * y.float()[..., None, :] + (comb[..., None] * h.float()[..., None, :]).sum(-3)
    return out.to(h.dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Final stream collapse (no Sinkhorn): h [..., hc, D] -> [..., D]."""
    pre = torch.sigmoid(hc_mixes(h, fn, cfg.rms_norm_eps) * scale + base) + cfg.hc_eps
    return (pre[..., None] * h.float()).sum(-2).to(h.dtype)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, scale: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., H, d], kv [..., N, d] (K = V, one shared head), sink [H] -> [..., H, d], fp32 math.
    valid [..., N] masks entries out (they get weight exactly 0)."""
    s = (q.float() @ kv.float().transpose(-1, -2)) * scale  # [..., H, N]
    if valid is not None:
        s = s.masked_fill(~valid[..., None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True) + torch.exp(sink.float()[:, None] - m)
    return ((e / denom) @ kv.float()).to(q.dtype)


def kv_sim(kv: torch.Tensor, nope: int) -> torch.Tensor:
    """fp8-simulate the nope dims of KV rows; the RoPE dims stay in full precision."""
    return torch.cat([formats.fp8_act_sim(kv[..., :nope], KV_SIM_BLOCK), kv[..., nope:]], -1)


def index_sim(x: torch.Tensor) -> torch.Tensor:
    """The indexer's simulation: normalized Hadamard rotation, then fp4 per 32."""
    return formats.fp4_act_sim(formats.hadamard_rotate(x), INDEX_SIM_BLOCK)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in fp32: silu(min(g, limit)) * clamp(u, -limit, limit)."""
    g, u = g.float(), u.float()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def route_weights(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Routing weights: scores of the chosen experts, normalized to sum 1, times the scaling."""
    w = scores.gather(-1, idx)
    return w / w.sum(-1, keepdim=True) * scaling
