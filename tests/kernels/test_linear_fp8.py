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
from megastep.kernels.linear_fp8 import _PINNED, _PINNED_SWIGLU, LinearFp8Config, linear_fp8, linear_fp8_ref, pick_config

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
    LinearFp8Config("f16", 16, 16, 128, 2),
    LinearFp8Config("f16", 128, 32, 128, 3, num_warps=8),
    LinearFp8Config("f16", 32, 64, 128, 1, num_stages=4),
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


@pytest.mark.parametrize("maxnreg", [96, 64])
def test_register_cap_changes_no_bit(maxnreg):
    """LinearFp8Config.maxnreg caps ptxas's registers (on the GPU; 64 spills): the same instructions,
    so the bits of the uncapped launch, within the ref's tolerance; a cap outside 32..255 is refused."""
    import dataclasses

    base = pick_config(1, 4096, 1024)
    capped = dataclasses.replace(base, maxnreg=maxnreg)
    x, w, s = make(1, 256, 1024, seed=maxnreg)
    y = linear_fp8(x, w, s, config=capped)
    assert torch.equal(y, linear_fp8(x, w, s, config=base))
    check(y, linear_fp8_ref(x, w, s))
    with pytest.raises(AssertionError):
        dataclasses.replace(base, maxnreg=16).check()


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


def test_every_row_tile_of_a_shape_takes_the_same_sums():
    """A row's bits must not depend on its batch: the configurations picked for one weight shape
    differ in the row tile only, pinned ones included. Mode, K step and split set the sums, and so
    do the warps: with fewer than 4 Triton runs the dot on mma.sync, whose k16 steps take other
    column sets than wgmma's (docs/PERFORMANCE.md, nineteenth measurement)."""
    def sums(c):
        return c.mode, c.block_k, c.split_k, c.num_warps

    for N, K in V4_SHAPES + [(4096, 8192), (8192, 4096), (2048, 4096)]:
        picked = {sums(pick_config(M, N, K)) for M in range(1, 65)}
        assert len(picked) == 1, (N, K, picked)
    for I, K in [(2048, 4096)]:
        assert len({sums(pick_config_swiglu(M, I, K)) for M in range(1, 65)}) == 1


def test_f16_is_picked_with_and_without_activation_quantization():
    assert pick_config(1, 4096, 8192).mode == "f16" and pick_config(64, 4096, 8192).mode == "f16"
    assert pick_config(1, 8192, 4096, quantize_act=False).mode == "f16"
    with pytest.raises(AssertionError, match="f16"):
        LinearFp8Config("f16", 64, 16, 256, 1).check()


@pytest.mark.parametrize("cfg", [None, LinearFp8Config("f16", 32, 16, 128, 3), LinearFp8Config("f16", 128, 32, 128, 1),
                                 LinearFp8Config("dot16", 64, 16, 256, 1)], ids=str)
@pytest.mark.parametrize("G", [1, 2])
def test_unquantized_activation_over_a_wide_range(cfg, G):
    """wo_a's bf16 activation in "f16" enters as fp16 after a power-of-two scale per 128-block:
    blocks 2^-40 .. 2^40 apart, and inside a block values 2^-10 .. 2^-28 of its amax, give the
    ref's fp32 result up to the order of the sums (what "dot16", exact in bf16, also shows).
    Each block's amax sits on a column whose weights are zero, so a block alone shows whether
    its small values survived the scaling."""
    M, R, K = 3, 128, 512
    g = torch.Generator(device=DEV).manual_seed(40 + G)
    x = torch.randn(M, G * K, generator=g, device=DEV)
    x = x * torch.exp2(torch.randint(-28, -9, (M, G * K), generator=g, device=DEV).float())  # in-block range
    x[:, ::128] = 1.0  # each block's amax
    x = x * torch.exp2(torch.tensor([-40.0, 40.0, 0.0, 7.0] * G, device=DEV)).repeat_interleave(128)  # per block
    x = x.to(torch.bfloat16)
    w = torch.randn(G * R, K, generator=g, device=DEV) * 0.05
    w[:, ::128] = 0.0  # ... meets zero weights
    w, s = F.quantize_fp8_weight(w, 128)
    for b in [None] + list(range(G * K // 128)):  # all blocks, then each block alone (the tiny ones show)
        xb = x if b is None else torch.zeros_like(x).index_copy(1, torch.arange(b * 128, b * 128 + 128, device=DEV),
                                                               x[:, b * 128:b * 128 + 128])
        y = linear_fp8(xb, w, s, out_dtype=torch.float32, config=cfg, quantize_act=False, groups=G)
        ref = linear_fp8_ref(xb, w, s, out_dtype=torch.float32, quantize_act=False, groups=G)
        assert torch.isfinite(y).all()
        assert ((y - ref).abs() <= 2.0**-18 * ref.abs().amax(1, keepdim=True)).all(), b
    check(linear_fp8(x, w, s, config=cfg, quantize_act=False, groups=G), linear_fp8_ref(x, w, s, quantize_act=False, groups=G))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 16, 64])
def test_gpu_wo_a_shape_matches_ref_and_is_deterministic(M):
    """V4-Flash's wo_a in one launch: 8 groups of 1024 rows, each over its 4096 columns of x, bf16 x."""
    G, R, K = 8, 1024, 4096
    x, w, s = make(M, G * R, G * K, seed=M, dev="cuda")
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    y1 = linear_fp8(x, w, s, quantize_act=False, groups=G)
    y2 = linear_fp8(x, w, s, quantize_act=False, groups=G)
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))
    check(y1, linear_fp8_ref(x, w, s, quantize_act=False, groups=G))


def test_f16_and_dot16_differ_only_in_summation_order():
    """Same products, other fp32 sums: both within one bf16 step of the ref, and in fp32 output
    within a few fp32 ulps of the row's magnitude of each other."""
    x, w, s = make(3, 192, 1024, seed=21)
    a = linear_fp8(x, w, s, out_dtype=torch.float32, config=LinearFp8Config("f16", 64, 16, 128, 2))
    b = linear_fp8(x, w, s, out_dtype=torch.float32, config=LinearFp8Config("dot16", 64, 16, 128, 2))
    ref = linear_fp8_ref(x, w, s, out_dtype=torch.float32)
    scale = ref.abs().amax(1, keepdim=True)
    assert ((a - b).abs() <= 2.0**-18 * scale).all() and ((a - ref).abs() <= 2.0**-18 * scale).all()


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


# ---- gated (w13 -> swiglu) and residual epilogues ------------------------------------------------
# linear_fp8_swiglu is checked three ways: its ref is the torch composition bit for bit; the kernel
# equals (GPU: within one bf16 step of) two linear_fp8 calls with the same configuration followed by
# ops.swiglu (same sums in the same order, so only silu's exp could differ); and it lies within the
# bound that g and u each one bf16 step off the ref's (the linear tolerance above) allow:
# |d(silu(g) u)| <= (|silu(g)| + 1.1 dg) du + |u| 1.1 dg  (|silu'| <= 1.1; clamps are 1-Lipschitz),
# plus the output's own rounding. The residual epilogue is plain fp32 adds: the kernel equals
# (y + linear_fp8(...).float()).to(dtype) with the same configuration exactly, and the ref within
# the linear tolerance (one rounding of the sum on top of the linear's step).
from megastep.kernels.linear_fp8 import linear_fp8_swiglu, linear_fp8_swiglu_ref, pick_config_swiglu  # noqa: E402
from megastep.model import ops  # noqa: E402

LIMIT = 10.0
# silu(g) for g < -88.7: exp(-g) overflows to inf and g / inf = -0, as in torch; numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def make_w13(M, I, K, seed, x_dtype=torch.bfloat16, dev=DEV):
    """x and w13 = cat(w1, w3) with gate/up magnitudes that reach past the clamp limit."""
    x, w, s = make(M, 2 * I, K, seed, x_dtype, dev)
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128) * 4, 128)
    return x, w, s


def swiglu_parts(x, w, s, od, cfg=None, fn=linear_fp8):
    I = w.shape[0] // 2
    kw = {} if fn is linear_fp8_ref else {"config": cfg}
    return fn(x, w[:I], s[:I // 128], out_dtype=od, **kw), fn(x, w[I:], s[I // 128:], out_dtype=od, **kw)


def check_swiglu(y, x, w, s, limit, cfg):
    od = y.dtype
    comp = ops.swiglu(*swiglu_parts(x, w, s, od, cfg), limit).to(od)
    check(y, comp)  # at most one step apart; bf16: bit-equal but for exp's last fp32 bit at a rounding tie
    if od == torch.bfloat16:
        assert (y != comp).float().mean().item() <= 0.01, f"{(y != comp).sum().item()} of {y.numel()} differ"
    g, u = (t.float() for t in swiglu_parts(x, w, s, od, fn=linear_fp8_ref))
    step = 2.0**-7 if od == torch.bfloat16 else 0.0
    dg = step * g.abs() + 1e-5 * g.abs().max()
    du = step * u.abs() + 1e-5 * u.abs().max()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    silu = torch.nn.functional.silu(g)
    ref = (silu * u).to(od).float()
    assert torch.equal(ref, linear_fp8_swiglu_ref(x, w, s, limit, od).float())
    tol = 1.01 * ((silu.abs() + 1.1 * dg) * du + u.abs() * 1.1 * dg) + (step or 1e-6) * ref.abs() + 1e-6 * ref.abs().max()
    bad = (y.float() - ref).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} elements off; worst {(y.float() - ref).abs().max().item()}"


def picked_swiglu_configs():
    cfgs = set(_PINNED_SWIGLU.values())
    for M in range(1, 65):
        for I, K in [(2048, 4096), (128, 256), (256, 384)]:
            cfgs.add(pick_config_swiglu(M, I, K))
    return sorted(cfgs, key=lambda c: (c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages))


SWIGLU_EXTRA = [
    LinearFp8Config("f16", 32, 16, 128, 3),
    LinearFp8Config("dot16", 16, 16, 512, 2),
    LinearFp8Config("dot16", 128, 32, 256, 1),
    LinearFp8Config("dot16", 64, 64, 128, 3, num_warps=8),
]


@pytest.mark.parametrize("cfg", picked_swiglu_configs() + SWIGLU_EXTRA, ids=str)
def test_swiglu_every_config(cfg):
    K = cfg.split_k * cfg.block_k + 96  # each split one or two K steps, a ragged last 128-block
    M = 1 if cfg.block_m == 16 else min(cfg.block_m - 3, 19)
    x, w, s = make_w13(M, 128, K, seed=K + cfg.block_n)
    check_swiglu(linear_fp8_swiglu(x, w, s, LIMIT, config=cfg), x, w, s, LIMIT, cfg)


def test_swiglu_rows_past_one_row_tile():
    """The shared w1/w3's pin runs more than 16 rows in several 16-row tiles (a grid of row tiles,
    each streaming the weight again): every tile's rows right, and a row's bits those it gets alone."""
    cfg = LinearFp8Config("f16", 64, 16, 128, 2, num_warps=2)
    x, w, s = make_w13(40, 128, 2 * 128 + 96, seed=40)
    y = linear_fp8_swiglu(x, w, s, LIMIT, config=cfg)
    check_swiglu(y, x, w, s, LIMIT, cfg)
    for r in (0, 17, 39):  # rows of the first, second and last (ragged) tile
        assert same_bits(linear_fp8_swiglu(x[r:r + 1].contiguous(), w, s, LIMIT, config=cfg), y[r:r + 1]), r


@pytest.mark.parametrize("M,I,K,limit,od", [(3, 256, 384, LIMIT, torch.bfloat16), (5, 128, 300, 0.0, torch.bfloat16),
                                            (17, 128, 256, LIMIT, torch.float32), (1, 256, 512, 2.5, torch.bfloat16)])
def test_swiglu_picked_config_odd_rows_and_limits(M, I, K, limit, od):
    x, w, s = make_w13(M, I, K, seed=M + I + K)
    y = linear_fp8_swiglu(x, w, s, limit, out_dtype=od)
    check_swiglu(y, x, w, s, limit, pick_config_swiglu(M, I, K))
    if limit > 0:  # the clamp is exercised
        g, u = swiglu_parts(x, w, s, od, fn=linear_fp8_ref)
        assert (g.float() > limit).any() and (u.float().abs() > limit).any()


def test_swiglu_ref_is_ops_swiglu_of_two_linears():
    x, w, s = make_w13(3, 128, 256, seed=3)
    for limit in (LIMIT, 0.0):
        assert torch.equal(linear_fp8_swiglu_ref(x, w, s, limit),
                           ops.swiglu(*swiglu_parts(x, w, s, torch.bfloat16, fn=linear_fp8_ref), limit).to(torch.bfloat16))


@pytest.mark.parametrize("cfg", [None, LinearFp8Config("dot16", 32, 16, 128, 3), LinearFp8Config("dot16", 64, 16, 256, 1)],
                         ids=str)
@pytest.mark.parametrize("od", [torch.bfloat16, torch.float32], ids=str)
def test_residual_epilogue(cfg, od):
    M, N, K = 3, 192, 384
    x, w, s = make(M, N, K, seed=11)
    g = torch.Generator(device=DEV).manual_seed(12)
    y = torch.randn(M, N, generator=g, device=DEV) * linear_fp8_ref(x, w, s).float().abs().mean()
    out = linear_fp8(x, w, s, out_dtype=od, config=cfg, residual=y)
    assert torch.equal(out, (y + linear_fp8(x, w, s, out_dtype=od, config=cfg).float()).to(od))
    check(out, linear_fp8_ref(x, w, s, out_dtype=od, residual=y))
    assert torch.equal(linear_fp8_ref(x, w, s, out_dtype=od, residual=y), (y + linear_fp8_ref(x, w, s, out_dtype=od).float()).to(od))
    # a bf16 residual is widened exactly
    yb = y.to(torch.bfloat16)
    assert torch.equal(linear_fp8(x, w, s, out_dtype=od, config=cfg, residual=yb),
                       linear_fp8(x, w, s, out_dtype=od, config=cfg, residual=yb.float()))


@pytest.mark.parametrize("split", [1, 4])
def test_epilogues_bit_identical_and_batch_invariant(split):
    """Same input, same bits (the split-K counters reset), and a row's output does not depend on
    the other rows or on M (for a fixed configuration; the picked one is fixed per M bucket)."""
    I, K = 128, 512
    x, w, s = make_w13(40, I, K, seed=21)
    w2, s2 = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128).T.contiguous()[:, :I] * 0.25, 128)  # [K, I]
    y = torch.randn(40, K, device=DEV)
    cfg = LinearFp8Config("dot16", 32, 16, 128, split)
    a = linear_fp8_swiglu(x, w, s, LIMIT, config=cfg)
    assert torch.equal(a, linear_fp8_swiglu(x, w, s, LIMIT, config=cfg))
    o = linear_fp8(a, w2, s2, residual=y, config=cfg)
    assert torch.equal(o, linear_fp8(a, w2, s2, residual=y, config=cfg))
    for rows in (slice(0, 1), slice(5, 21)):
        assert torch.equal(a[rows], linear_fp8_swiglu(x[rows], w, s, LIMIT, config=cfg))
        assert torch.equal(o[rows], linear_fp8(a[rows], w2, s2, residual=y[rows], config=cfg))
    # picked configuration: rows 0..15 (one bucket) give the same bits at M = 1, 7 and 16
    for M in (1, 7):
        assert torch.equal(linear_fp8_swiglu(x[:M], w, s, LIMIT), linear_fp8_swiglu(x[:16], w, s, LIMIT)[:M])
        assert torch.equal(linear_fp8(a[:M], w2, s2, residual=y[:M]), linear_fp8(a[:16], w2, s2, residual=y[:16])[:M])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 16, 64])
def test_gpu_shared_expert_shapes(M):
    """V4-Flash shared expert: w13 [4096, 4096] gated, w2 [4096, 2048] with the routed sum added."""
    x, w13, s13 = make_w13(M, 2048, 4096, seed=M, dev="cuda")
    a1, a2 = linear_fp8_swiglu(x, w13, s13, LIMIT), linear_fp8_swiglu(x, w13, s13, LIMIT)
    torch.cuda.synchronize()
    assert torch.equal(a1, a2)
    check_swiglu(a1, x, w13, s13, LIMIT, pick_config_swiglu(M, 2048, 4096))
    _, w2, s2 = make(M, 4096, 2048, seed=M + 1, dev="cuda")
    y = torch.randn(M, 4096, device="cuda")
    o1, o2 = linear_fp8(a1, w2, s2, residual=y), linear_fp8(a1, w2, s2, residual=y)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)
    assert torch.equal(o1, (y + linear_fp8(a1, w2, s2).float()).to(torch.bfloat16))
    check(o1, linear_fp8_ref(a1, w2, s2, residual=y))


# ---- activation codes made by x's producer (x_codes) ----------------------------------------------
def codes_of(x):
    """formats.fp8_act_quant of x, a ragged last block on its own amax (zeros pad it)."""
    K = x.shape[1]
    q, s = F.fp8_act_quant(torch.nn.functional.pad(x.float(), (0, -K % 128)), 128)
    return q[:, :K].contiguous(), s


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("M,N,K", [(1, 192, 640), (3, 200, 300), (20, 64, 256)])
def test_x_codes_give_the_same_bits(M, N, K):
    """The "f16" loop fed with x's codes computes exactly what it computes quantizing x itself;
    "dot16" ignores them; the gated and residual epilogues too."""
    x, w, s = make(M, N, K, seed=M + N + K)
    c = codes_of(x)
    for cfg in (None, LinearFp8Config("f16", 32, 16 if M <= 16 else 32, 128, 2), LinearFp8Config("dot16", 64, 32, 256, 1)):
        assert same_bits(linear_fp8(x, w, s, config=cfg, x_codes=c), linear_fp8(x, w, s, config=cfg))
    res = torch.randn(M, N, device=DEV)
    assert same_bits(linear_fp8(x, w, s, out_dtype=torch.float32, residual=res, x_codes=c),
                     linear_fp8(x, w, s, out_dtype=torch.float32, residual=res))
    xg, wg, sg = make_w13(M, 128, K, seed=M + K)
    assert same_bits(linear_fp8_swiglu(xg, wg, sg, LIMIT, x_codes=codes_of(xg)), linear_fp8_swiglu(xg, wg, sg, LIMIT))


@pytest.mark.parametrize("M,N,K,C", [(1, 384, 640, 256), (3, 200, 300, 128), (20, 256, 1024, 256)])
@pytest.mark.parametrize("od", [torch.bfloat16, torch.float32], ids=str)
def test_norm_tail_gives_the_norm_launchs_bits(M, N, K, C, od):
    """norm_tail=: the linear's output unchanged, and beside it rms_norm(y[:, :C], codes=True) of
    that output, bit for bit, for any row tile and split (the last program of a row tile's C columns
    makes it); rows of very different magnitudes, so the norm matters."""
    from megastep.kernels import rope_norm as rn

    x, w, s = make(M, N, K, seed=M * K + C)
    x = x * torch.exp2(torch.arange(M, device=DEV) % 7 * 3.0 - 9).to(x.dtype)[:, None]
    nw = (torch.rand(C, generator=torch.Generator().manual_seed(C)) + 0.5).to(DEV)
    mb = 16 if M <= 16 else 32
    for cfg in (None, LinearFp8Config("f16", 32, mb, 128, 2), LinearFp8Config("f16", 64, 16, 128, 1)):
        y = linear_fp8(x, w, s, config=cfg, out_dtype=od)
        got, (normed, (c, sc)) = linear_fp8(x, w, s, config=cfg, out_dtype=od, norm_tail=(nw, 1e-6))
        want, (wc, wsc) = rn.rms_norm(y[:, :C], nw, 1e-6, codes=True)
        assert same_bits(got, y) and same_bits(normed, want), (cfg, od)
        assert torch.equal(c.view(torch.uint8), wc.view(torch.uint8)) and torch.equal(sc, wsc)
        assert same_bits(linear_fp8(x, w, s, config=cfg, out_dtype=od, norm_tail=(nw, 1e-6))[1][0], want)  # again


def test_norm_tail_refuses_what_it_does_not_run():
    x, w, s = make(2, 256, 256, seed=4)
    nw = torch.ones(256, device=DEV)
    with pytest.raises(AssertionError):  # columns that are not whole tiles
        linear_fp8(x, w, s, norm_tail=(nw[:100].contiguous(), 1e-6))
    with pytest.raises(AssertionError):  # more columns than the output has
        linear_fp8(x, w, s, norm_tail=(torch.ones(384, device=DEV), 1e-6))
    with pytest.raises(AssertionError):
        linear_fp8(x, w, s, norm_tail=(nw, 1e-6), residual=torch.zeros(2, 256, device=DEV))


def test_x_codes_of_the_wrong_shape_are_refused():
    x, w, s = make(2, 64, 256, seed=3)
    q, sc = codes_of(x)
    with pytest.raises(AssertionError):
        linear_fp8(x, w, s, x_codes=(q[:, :128], sc))
    with pytest.raises(AssertionError):
        linear_fp8(x, w, s, x_codes=(q, sc.double()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["x_group", "x_group_norm", "qr_group", "wo_a", "wo_b", "shared_w13", "shared_w2"])
@pytest.mark.parametrize("od", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_a_row_gets_the_same_bits_in_every_row_tile(kind, od):
    """The V4-Flash FP8 linears with their picked (pinned) configurations: a row computed in a step
    of 1, 16, 17 or 64 rows (row tiles of 16, 32 and 64; the shared w1/w3's former 2-warp pin at 16
    rows would fail it) gives the bits it gets in a batch of 64; fp32 output shows every bit of the sums."""
    N, K = {"x_group": (1536, 4096), "x_group_norm": (1536, 4096), "qr_group": (40960, 1024), "wo_a": (8192, 4096),
            "wo_b": (4096, 8192), "shared_w13": (2048, 4096), "shared_w2": (4096, 2048)}[kind]
    if kind == "shared_w13":
        x, w, s = make_w13(64, N, K, seed=5, dev="cuda")
        fn = lambda xs: linear_fp8_swiglu(xs, w, s, LIMIT, out_dtype=od)  # noqa: E731
    elif kind == "wo_a":
        G = 8
        x, w, s = make(64, N, G * K, seed=5, dev="cuda")
        w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
        fn = lambda xs: linear_fp8(xs, w, s, out_dtype=od, quantize_act=False, groups=G)  # noqa: E731
    elif kind == "x_group_norm":  # the q norm made by the x group's launch (fast.QNORM_TAIL_ROWS): the normed rows
        from megastep.kernels import rope_norm as rn

        x, w, s = make(64, N, K, seed=5, dev="cuda")
        nw = torch.rand(1024, generator=torch.Generator().manual_seed(6)).cuda() + 0.5
        fn = lambda xs: linear_fp8(xs, w, s, out_dtype=od, norm_tail=(nw, 1e-6))[1][0]  # noqa: E731
        assert same_bits(fn(x), rn.rms_norm(linear_fp8(x, w, s, out_dtype=od)[:, :1024], nw, 1e-6))
    else:
        x, w, s = make(64, N, K, seed=5, dev="cuda")
        fn = lambda xs: linear_fp8(xs, w, s, out_dtype=od)  # noqa: E731
    full = fn(x)
    for m in (1, 16, 17):
        assert same_bits(fn(x[:m].contiguous()), full[:m]), m


@pytest.mark.parametrize("M", [1, 5])
def test_a_groups_part_alone_gives_the_group_launchs_bits(M, monkeypatch):
    """LinearGroup.part: one part of a fused group in a launch of its own, with the group launch's
    configuration (here pinned to a split of K that the parts' own shapes would not take), gives
    the bits of that part of the group launch, with and without x's codes; the parts' own picks
    give other bits (fp32 output shows them), so a part that ignored the group's would fail."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.model.linears import Linear, LinearGroup

    monkeypatch.setitem(lin._PINNED, (384, 512, 16), LinearFp8Config("f16", 64, 16, 128, 2))
    x, w, s = make(M, 384, 512, seed=7 + M, x_dtype=torch.float32)
    parts = [Linear(w[:256], s[:2], 128, True), Linear(w[256:], s[2:], 128, True)]
    group = LinearGroup(parts)
    assert group.fused is not None and pick_config(M, 256, 512).split_k == pick_config(M, 128, 512).split_k == 4
    for codes in (None, codes_of(x)):
        whole = group(x, True, codes=codes)
        for i in (0, 1):
            assert same_bits(group.part(i, x, True, codes=codes), whole[i])
    assert not all(same_bits(p(x, True), whole[i]) for i, p in enumerate(parts))


@pytest.mark.parametrize("M", [1, 5])
def test_a_ranks_rows_with_like_rows_give_the_full_groups_bits(M, monkeypatch):
    """Tensor parallelism's row shares (FastDecoder(attn_split=True)): a group built from a block
    of one part's rows plus another whole part, launched with `like_rows` = the full group's rows,
    gives those rows' bits of the full group launch (whose pinned split the share's own shape would
    not take), in one launch and part by part, with and without x's codes."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.model.linears import Linear, LinearGroup

    monkeypatch.setitem(lin._PINNED, (384, 512, 16), LinearFp8Config("f16", 64, 16, 128, 2))
    x, w, s = make(M, 384, 512, seed=3 + M, x_dtype=torch.float32)
    full = LinearGroup([Linear(w[:256], s[:2], 128, True), Linear(w[256:], s[2:], 128, True)])

    def share_parts():
        return [Linear(w[128:256], s[1:2], 128, True), Linear(w[256:], s[2:], 128, True)]

    share = LinearGroup(share_parts(), like_rows=384)
    assert share.fused is not None and pick_config(M, 256, 512).split_k == 4
    for codes in (None, codes_of(x)):
        whole = full(x, True, codes=codes)
        got = share(x, True, codes=codes)
        assert same_bits(got[0], whole[0][:, 128:]) and same_bits(got[1], whole[1])
        assert same_bits(share.part(0, x, True, codes=codes), whole[0][:, 128:])
    # the share's own configuration (4 splits) sums otherwise: fp32 output shows it
    assert not same_bits(LinearGroup(share_parts())(x, True)[1], whole[1])


def test_like_rows_needs_one_launch():
    from megastep.model.linears import Linear, LinearGroup

    x, w, s = make(1, 200, 256, seed=1)
    with pytest.raises(ValueError, match="one launch"):
        LinearGroup([Linear(w[:100], s[:1], 128, True), Linear(w[100:], s[1:], 128, True)], like_rows=400)


@pytest.mark.parametrize("M", [1, 3])
def test_a_ranks_groups_of_wo_a_take_the_full_launchs_bits(M, monkeypatch):
    """wo_a's groups split over ranks: a block of groups with the full launch's configuration gives
    those groups' output columns of the full grouped launch, bit for bit."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.model.linears import Linear

    G, R, K = 4, 128, 256
    monkeypatch.setitem(lin._PINNED, (G * R, K, 16), LinearFp8Config("f16", 64, 16, 128, 2))
    x, w, s = make(M, G * R, G * K, seed=M)
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    whole = Linear(w, s, 128, False).grouped(x.view(M, G, K), G, R, True)
    cfg = pick_config(M, G * R, K)
    for W in (2, 4):
        Gl = G // W
        for r in range(W):
            rows = slice(r * Gl * R, (r + 1) * Gl * R)
            mine = Linear(w[rows], s[r * Gl * R // 128:(r + 1) * Gl * R // 128], 128, False)
            got = mine.grouped(x.view(M, G, K)[:, r * Gl:(r + 1) * Gl], Gl, R, True, config=cfg)
            assert same_bits(got, whole[:, rows]), (W, r)
