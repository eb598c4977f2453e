"""Next-token sampling on the device, inside the step's CUDA graph.

Per row: temperature (0 = greedy: argmax, lowest index on ties), top-k (0 = off), top-p (1 = off)
and a seed. Randomness is counter-based: the noise of vocabulary entry v at decode position p of a
row with seed s is a hash of (s, p, v) (splitmix64), so a row's token depends on nothing but its
own logits, seed and position: the same in every run, alone or in any batch, eager or replayed,
and no generator state has to live in the graph.

Sampling is the Gumbel-max trick over the kept candidates: argmax(logits / T + G) with
G = -log(-log(u)) picks v with probability softmax(logits / T)[v] renormalized over the kept set.
Top-k and top-p cut on the distribution sorted by probability (ties by lower index), top-k
first, then the smallest prefix whose mass reaches top-p, as the host sampler does.
"""

from __future__ import annotations

import torch

_M1, _M2, _GOLD = -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15, -0x61C8864680B583EB  # splitmix64 constants, int64
_LOW53 = (1 << 53) - 1


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLD
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def uniform_noise(seed: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1), float64 [B, vocab]: a pure function of (seed, pos, vocabulary index)."""
    v = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    key = splitmix64(splitmix64(seed.long() * 1_000_003 + pos.long())[:, None] + v[None, :])
    return (_srl(key, 11) & _LOW53).double().add_(0.5).mul_(2.0**-53)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32; temperature, top_p [B] f32; top_k, seed, pos [B] i64 -> tokens [B] i64."""
    B, V = logits.shape
    greedy = torch.argmax(logits, dim=-1)
    t = torch.where(temperature > 0, temperature, 1.0).double()
    z = logits.double() / t[:, None]
    # candidates by probability; a stable sort keeps equal logits in index order
    zs, order = torch.sort(z, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]
    keep = rank < k
    p = torch.softmax(zs.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(p, dim=-1) - p  # mass of the better candidates
    # the smallest prefix reaching top_p (the first candidate always); top_p >= 1 cuts nothing
    keep &= (before < top_p.double()[:, None]) | (top_p[:, None] >= 1)
    g = -torch.log(-torch.log(uniform_noise(seed, pos, V).gather(1, order)))
    pick = torch.argmax((zs + g).masked_fill(~keep, float("-inf")), dim=-1)
    sampled = order.gather(1, pick[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, greedy)
