"""sparse_attention_decode against ops.sparse_attention: random inputs, ragged N (masked tails,
fully masked chunks), garbage in masked rows, every configuration the wrapper picks plus odd
ones, batch invariance and determinism.

Tolerance: scores are exact-product fp32 dots; the weighted sum uses the softmax weights split
into bf16 pieces (error <= 2^-17 relative with two pieces) and the online-softmax rescaling, so
the kernel and the ref differ at fp32 noise level: outputs must be at most one bf16 step from
the ref (or within 1e-5 max|ref| where the weighted sum cancels) and bit-equal in >= 99%.
"""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.attention" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.attention"])  # imported before the interpreter was set

from megastep.kernels import attention  # noqa: E402
from megastep.kernels.attention import AttnConfig, pick_config, sparse_attention_decode, sparse_attention_decode_ref  # noqa: E402
from bf16_check import check_bf16 as check  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, H, N, d, seed, p_valid=0.7, dev=DEV):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, d, generator=g) * 2
    kv = torch.randn(B, N, d, generator=g) * torch.exp2(torch.randint(-2, 2, (B, N, 1), generator=g).float())
    valid = torch.rand(B, N, generator=g) < p_valid
    valid[:, 0] = True  # the current token is always attended
    sink = torch.randn(H, generator=g)
    return q.bfloat16().to(dev), kv.bfloat16().to(dev), valid.to(dev), sink.to(dev)


def run(args, cfg=None):
    q = args[0]
    return sparse_attention_decode(*args, q.shape[-1] ** -0.5, config=cfg)


def ref(args):
    return sparse_attention_decode_ref(*args, args[0].shape[-1] ** -0.5)


def picked_configs():
    cfgs = {pick_config(H, N, 512) for H in (64, 8) for N in (1, 128, 640, 2000, 8320)}
    return sorted(cfgs, key=str)


EXTRA = [AttnConfig(16, 16, 16), AttnConfig(16, 16, 48, pv_pieces=3), AttnConfig(32, 64, 64, num_warps=4),
         AttnConfig(64, 32, 96)]


@pytest.mark.parametrize("cfg", picked_configs() + EXTRA, ids=str)
def test_every_config_matches_ref(cfg):
    # N ragged against block_n and chunk; several chunks; heads ragged against block_h
    N = 2 * cfg.chunk + cfg.block_n // 2 + 3
    H = cfg.block_h + 4 if cfg.block_h < 64 else 40
    args = make(2, H, N, 32, seed=cfg.chunk + cfg.block_h)
    check(run(args, cfg), ref(args))


@pytest.mark.parametrize("B,H,N,d", [(1, 4, 1, 32), (3, 8, 50, 64), (1, 64, 640, 512), (2, 6, 130, 16)])
def test_shapes_with_picked_config(B, H, N, d):
    args = make(B, H, N, d, seed=B + H + N)
    check(run(args), ref(args))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy dot overflows on the junk
def test_masked_entries_contribute_exactly_zero():
    """Garbage (huge but finite) in masked rows, fully masked chunks, masked tails."""
    cfg = AttnConfig(16, 16, 32)
    q, kv, valid, sink = make(3, 8, 150, 32, seed=4, p_valid=0.5)
    valid[1, 40:] = False  # chunks 2..4 of row 1 have nothing valid
    valid[2, :] = False
    valid[2, 149] = True  # only the last entry of the last chunk
    clean = torch.where(valid[..., None], kv, torch.zeros_like(kv))
    junk = torch.randn(kv.shape, device=DEV) * 1e30
    junk[0, :, :4] = 3.0e38  # scores overflow to inf (and inf - inf = NaN inside the dot)
    dirty = torch.where(valid[..., None], kv, junk.bfloat16())
    a = run((q, clean, valid, sink), cfg)
    b = run((q, dirty, valid, sink), cfg)
    assert torch.equal(a, b)
    check(a, ref((q, clean, valid, sink)))


def test_row_without_valid_entries_gives_zero():
    q, kv, valid, sink = make(2, 8, 70, 32, seed=5)
    valid[1] = False
    for cfg in (AttnConfig(16, 16, 16), AttnConfig(16, 32, 96)):  # split and unsplit
        o = run((q, kv, valid, sink), cfg)
        assert torch.equal(o[1].float(), torch.zeros_like(o[1].float()))
        check(o[:1], ref((q[:1], kv[:1], valid[:1], sink)))


@pytest.mark.parametrize("cfg", [None, AttnConfig(16, 16, 32)], ids=str)
def test_batch_invariant_and_deterministic(cfg):
    args = make(5, 8, 100, 32, seed=6)
    full = run(args, cfg)
    assert torch.equal(full, run(args, cfg))
    for rows in (slice(0, 1), slice(4, 5), slice(1, 4)):
        assert torch.equal(run([t[rows] if t.dim() > 1 else t for t in args], cfg), full[rows])


def test_strided_inputs_and_counters_reused():
    """q / kv / valid as views of larger buffers (the decode step gathers them); repeated and
    interleaved calls of different shapes keep the arrival counters consistent."""
    q, kv, valid, sink = make(3, 8, 90, 32, seed=8)
    qb = torch.zeros(3, 10, 64, dtype=q.dtype, device=DEV)
    qb[:, :8, :32] = q
    kvb = torch.zeros(3, 100, 48, dtype=kv.dtype, device=DEV)
    kvb[:, :90, :32] = kv
    vb = torch.zeros(3, 95, dtype=torch.bool, device=DEV)
    vb[:, :90] = valid
    cfg = AttnConfig(16, 16, 32)
    r1 = ref((q, kv, valid, sink))
    other = make(2, 4, 40, 16, seed=9)
    r2 = run(other, cfg)
    for _ in range(2):
        o = sparse_attention_decode(qb[:, :8, :32], kvb[:, :90, :32], vb[:, :90], sink, 32**-0.5, config=cfg)
        check(o, r1)
        assert torch.equal(run(other, cfg), r2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N", [128, 640, 128 + 2048])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_v4_shapes(B, N):
    args = make(B, 64, N, 512, seed=B + N, dev="cuda")
    o = run(args)
    assert torch.equal(o, run(args))
    assert torch.equal(o[:1], run([t[:1] if t.dim() > 1 else t for t in args]))
    check(o, ref(args))
