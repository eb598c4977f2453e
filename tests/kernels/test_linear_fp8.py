"""linear_fp8 against linear_fp8_ref: random inputs, ragged and edge shapes, every configuration
the wrapper can pick, split-K with its ordered reduction.

Tolerance: the kernel and the ref multiply the same exact values (e4m3 * 2^k products are exact
in fp32) and differ only in the order of the fp32 sums (~1e-6 relative to the sum of |terms|).
A bf16 output therefore equals the ref's or is one bf16 step away where the fp32 sum sat next
to a rounding boundary; one step is at most 2^-7 |ref|: |y - ref| <= 2^-7 |ref| + 1e-5 max|ref|
(the second term covers cancellation). fp32 outputs must agree to 1e-5 * max|ref|.
"""

import pytest
import torch

from megastep.checkpoint import formats as F
from megastep.kernels.linear_fp8 import _PINNED, LinearFp8Config, linear_fp8, linear_fp8_ref, pick_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V4_SHAPES = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048), (8192, 1024)]


def make(M, N, K, seed, x_dtype=torch.bfloat16, dev=DEV):
    g = torch.Generator(device=dev).manual_seed(seed)
    kb = -(-K // 128)
    # per-block spread of magnitudes so that the block scales differ
    x = torch.randn(M, K, generator=g, device=dev) * torch.exp2(
        torch.randint(-4, 5, (1, kb), generator=g, device=dev).float()).repeat_interleave(128, 1)[:, :K]
    w = torch.randn(N, K, generator=g, device=dev) * torch.exp2(torch.randint(-6, 0, (N, 1), generator=g, device=dev).float())
    w, s = F.quantize_fp8_weight(w, 128)
    return x.to(x_dtype), w, s


def check(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    bf16 = y.dtype == torch.bfloat16
    y, ref = y.float().cpu(), ref.float().cpu()
    assert torch.isfinite(y).all()
    atol = 1e-5 * ref.abs().max().item()
    tol = (2.0**-7 if bf16 else 0.0) * ref.abs() + atol
    bad = (y - ref).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} elements off; worst {(y - ref).abs().max().item()} (max|ref| {ref.abs().max().item()})"


def picked_configs():
    """Every configuration pick_config returns over decode shapes (M 1..64, V4 and small shapes)."""
    cfgs = set(_PINNED.values())
    for M in range(1, 65):
        for N, K in V4_SHAPES + [(96, 384), (200, 300), (64, 128)]:
            cfgs.add(pick_config(M, N, K))
    return sorted(cfgs, key=lambda c: (c.mode, c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages))


# configurations beyond what the picker chooses today: odd splits, every block size
EXTRA = [
    LinearFp8Config("dot16", 16, 16, 512, 2),
    LinearFp8Config("dot16", 32, 16, 128, 3),
    LinearFp8Config("dot16", 128, 32, 256, 1),
    LinearFp8Config("dot16", 64, 64, 128, 2, num_warps=8),
]


@pytest.mark.parametrize("cfg", picked_configs() + EXTRA, ids=str)
def test_every_config_matches_ref(cfg):
    # K gives each split one or two loop steps and a ragged last 128-block; N is ragged
    K = max(1, cfg.split_k) * cfg.block_k + 96
    N = cfg.block_n + 24
    M = 1 if cfg.block_m == 16 else min(cfg.block_m - 3, 19)
    x, w, s = make(M, N, K, seed=cfg.block_n + K)
    check(linear_fp8(x, w, s, config=cfg), linear_fp8_ref(x, w, s))
    check(linear_fp8(x, w, s, out_dtype=torch.float32, config=cfg), linear_fp8_ref(x, w, s, out_dtype=torch.float32))


@pytest.mark.parametrize(
    "M,N,K",
    [(1, 64, 128), (1, 96, 384), (3, 200, 300), (1, 1, 128), (4, 130, 100), (16, 70, 640), (17, 64, 256), (64, 40, 256)],
)
def test_edge_shapes_with_picked_config(M, N, K):
    x, w, s = make(M, N, K, seed=M * 1000 + N)
    check(linear_fp8(x, w, s), linear_fp8_ref(x, w, s))


@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (3, 200, 300), (5, 1024, 512)])
def test_without_activation_quantization(M, N, K):
    """quantize_act=False (wo_a): the bf16 activation meets the dequantized weight as it is."""
    x, w, s = make(M, N, K, seed=7 * M + N)
    ref = linear_fp8_ref(x, w, s, quantize_act=False)
    assert torch.allclose(ref, (x.float() @ F.dequantize_fp8_weight(w, s, 128).T).to(torch.bfloat16))
    assert not torch.equal(ref, linear_fp8_ref(x, w, s))  # the quantization would have changed it
    check(linear_fp8(x, w, s, quantize_act=False), ref)


@pytest.mark.parametrize("M,G,R,K", [(1, 2, 128, 256), (3, 4, 128, 128), (2, 2, 256, 384)])
def test_grouped_is_one_linear_per_group(M, G, R, K):
    """groups=G (wo_a in one launch): output rows of group g see only input columns of group g."""
    x, w, s = make(M, G * R, G * K, seed=M + 10 * G)  # x [M, G*K]; keep w's first K columns
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    ref = linear_fp8_ref(x, w, s, quantize_act=False, groups=G)
    per_group = torch.cat([linear_fp8_ref(x[:, g * K:(g + 1) * K], w[g * R:(g + 1) * R], s[g * R // 128:(g + 1) * R // 128],
                                          quantize_act=False) for g in range(G)], -1)
    assert torch.equal(ref, per_group)
    check(linear_fp8(x, w, s, quantize_act=False, groups=G), ref)


def test_fp32_input_and_strided_rows():
    x, w, s = make(3, 80, 256, seed=5, x_dtype=torch.float32)
    xs = torch.cat([x, x], 1)[:, :256]  # row stride 512
    check(linear_fp8(xs, w, s, out_dtype=torch.float32), linear_fp8_ref(x, w, s, out_dtype=torch.float32))


def test_split_k_workspace_reused_across_calls():
    """The arrival counters reset themselves: repeated and interleaved calls stay right."""
    a = make(1, 96, 512, seed=1)
    b = make(2, 64, 1024, seed=2)
    cfg = LinearFp8Config("dot16", 32, 16, 128, 4)
    ra, rb = linear_fp8_ref(*a), linear_fp8_ref(*b)
    for _ in range(2):
        check(linear_fp8(*a, config=cfg), ra)
        check(linear_fp8(*b, config=cfg), rb)


def test_more_than_64_rows_take_several_row_tiles():
    x, w, s = make(130, 40, 256, seed=0)
    check(linear_fp8(x, w, s), linear_fp8_ref(x, w, s))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", V4_SHAPES)
@pytest.mark.parametrize("M", [1, 4, 16, 64])
def test_gpu_v4_shapes_match_ref_and_are_deterministic(M, N, K):
    x, w, s = make(M, N, K, seed=M + N + K, dev="cuda")
    y1 = linear_fp8(x, w, s)
    y2 = linear_fp8(x, w, s)
    torch.cuda.synchronize()
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))
    check(y1, linear_fp8_ref(x, w, s))
