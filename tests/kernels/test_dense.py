"""linear_bf16 against linear_bf16_ref: random inputs, ragged shapes, every configuration the
wrapper picks plus odd splits, batch invariance, determinism and the split-K counters.

Tolerance: bf16 x bf16 products are exact in fp32, so the kernel differs from the ref only in
the order of the fp32 sums: |y - ref| <= 1e-6 * (|x| @ |w|^T) elementwise (about 8 fp32 ulps of
the sum of |terms|); a bf16 output is then the ref's or one bf16 step away.
"""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.dense" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.dense"])  # imported before the interpreter was set

from megastep.kernels import dense  # noqa: E402
from megastep.kernels.dense import DenseConfig, linear_bf16, linear_bf16_ref, pick_config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# compressor wkv/wgate (CSA, HCA, indexer), router gate, indexer weights_proj, lm head, and the
# step's concatenation of a CSA layer's (compressor, indexer compressor, weights_proj: model/fast.py's
# x_dense; an HCA layer's is (1024, 4096))
V4_SHAPES = [(1024, 4096), (512, 4096), (256, 4096), (64, 4096), (129280, 4096), (2624, 4096)]


def make(M, N, K, seed, x_dtype=torch.bfloat16, dev=DEV):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g).float())).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
    return x.to(x_dtype).to(dev), w.to(dev)


def check(y, x, w, out_dtype=torch.float32):
    ref = linear_bf16_ref(x, w, out_dtype)
    assert y.shape == ref.shape and y.dtype == ref.dtype == out_dtype
    y, ref = y.float().cpu(), ref.float().cpu()
    assert torch.isfinite(y).all()
    bound = 1e-6 * (x.float().abs() @ w.float().abs().T).cpu()
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    bad = (y - ref).abs() > bound
    assert not bad.any(), f"{bad.sum().item()} elements off; worst {(y - ref).abs().max().item()}"


def picked_configs():
    cfgs = set(dense._PINNED.values())
    for N, K in V4_SHAPES + [(200, 300), (64, 128), (1, 40), (3000, 520)]:
        cfgs.add(pick_config(N, K))
    return sorted(cfgs, key=str)


EXTRA = [DenseConfig(16, 32, 3), DenseConfig(128, 64, 2, num_warps=8), DenseConfig(32, 256, 1), DenseConfig(64, 128, 5)]


@pytest.mark.parametrize("cfg", picked_configs() + EXTRA, ids=str)
def test_every_config_matches_ref(cfg):
    # each split gets one or two K steps and a ragged end; N ragged; two row tiles
    K = cfg.split_k * cfg.block_k + 40
    N = cfg.block_n + 24
    x, w = make(19, N, K, seed=cfg.block_n + K)
    check(linear_bf16(x, w, config=cfg), x, w)
    check(linear_bf16(x[:3], w, out_dtype=torch.bfloat16, config=cfg), x[:3], w, torch.bfloat16)


@pytest.mark.parametrize("M,N,K", [(1, 64, 128), (1, 1, 40), (3, 200, 300), (17, 70, 1000), (64, 40, 256), (2, 300, 4096)])
def test_edge_shapes_with_picked_config(M, N, K):
    x, w = make(M, N, K, seed=M * 1000 + N)
    check(linear_bf16(x, w), x, w)


def test_fp32_input_and_strided_rows():
    x, w = make(3, 80, 256, seed=5, x_dtype=torch.float32)
    xs = torch.cat([x, x], 1)[:, :256]  # row stride 512
    check(linear_bf16(xs, w), x, w)
    assert torch.equal(linear_bf16(xs, w), linear_bf16(x.bfloat16(), w))


@pytest.mark.parametrize("cfg", [None, DenseConfig(16, 32, 3)], ids=str)
def test_batch_invariant_and_deterministic(cfg):
    x, w = make(37, 72, 200, seed=9)
    full = linear_bf16(x, w, config=cfg)
    assert torch.equal(full, linear_bf16(x, w, config=cfg))
    for rows in (slice(0, 1), slice(0, 5), slice(20, 21), slice(16, 37)):
        assert torch.equal(linear_bf16(x[rows], w, config=cfg), full[rows])


def test_split_k_counters_reset_across_calls():
    a, b = make(1, 48, 512, seed=1), make(20, 40, 1024, seed=2)
    cfg = DenseConfig(16, 64, 4)
    ra, rb = linear_bf16(*a, config=cfg), linear_bf16(*b, config=cfg)
    for _ in range(2):
        assert torch.equal(linear_bf16(*a, config=cfg), ra)
        assert torch.equal(linear_bf16(*b, config=cfg), rb)
    check(ra, *a)
    check(rb, *b)


def test_picked_configs_fill_the_device_at_m1():
    for N, K in V4_SHAPES:
        cfg = pick_config(N, K)
        tiles = -(-N // cfg.block_n)
        assert tiles * cfg.split_k >= 64, (N, K, cfg)  # enough programs at M = 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", V4_SHAPES)
@pytest.mark.parametrize("M", [1, 5, 16, 64])
def test_gpu_v4_shapes(M, N, K):
    x, w = make(M, N, K, seed=M + N, dev="cuda")
    y = linear_bf16(x, w)
    assert torch.equal(y, linear_bf16(x, w))
    assert torch.equal(y[:1], linear_bf16(x[:1], w))
    check(y, x, w)
