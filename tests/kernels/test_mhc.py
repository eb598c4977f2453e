"""mhc_pre / mhc_head / mhc_post against their refs (model/ops.py itself): random inputs, ragged
and edge shapes, every configuration the wrappers pick plus small ones that force several mixes
programs and D chunks, batch invariance and determinism.

Tolerances: the kernels round at the same points as ops and differ only in the fp32 order of the
hc*D-long mixes sums (and exp/sigmoid/sqrt ulps). So fp32 outputs (post, comb) must be as close
to the exact (float64) result as the fp32 ref is, within a small factor; bf16 outputs must be at
most one bf16 step from the ref (or within 1e-5 max|ref| where a sum cancels), and bit-equal in
at least 99% of the elements. hc_post has no long sum: bit-equal on CPU.

The finish kernel sums in fixed trees, so configurations that differ only in the finish (block_d,
finish_warps, sinkhorn_apart, sinkhorn_scalar), in block_m or in post_block_d must give the same
bits (on the GPU too, where the thread layout changes with them).
"""

import importlib
import os
import sys
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.mhc" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.mhc"])  # imported before the interpreter was set

from megastep.kernels import mhc  # noqa: E402
from megastep.kernels.mhc import MhcConfig, mhc_head, mhc_head_ref, mhc_post, mhc_post_ref, mhc_pre, mhc_pre_ref  # noqa: E402
from megastep.kernels.split_combine import sum_splits_ref  # noqa: E402
from megastep.model import ops  # noqa: E402
from bf16_check import check_bf16  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HC, ITERS, HC_EPS, EPS = 4, 20, 1e-6, 1e-6


def check_f32(y: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor) -> None:
    """The kernel is as close to the exact result as the fp32 ref, within a factor 4."""
    y, ref32, ref64 = y.cpu().double(), ref32.cpu().double(), ref64.cpu().double()
    assert y.shape == ref64.shape
    err, ref_err = (y - ref64).abs().max().item(), (ref32 - ref64).abs().max().item()
    assert err <= 4 * ref_err + 1e-7, f"kernel error {err} vs ref error {ref_err}"


def make(B, D, seed, head=False, dev=DEV):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mix = HC if head else (2 + HC) * HC
    # streams of different magnitudes, channels of different magnitudes
    h = torch.randn(B, HC, D, generator=g) * torch.exp2(torch.randint(-2, 3, (B, HC, 1), generator=g).float())
    fn = torch.randn(mix, HC * D, generator=g) * (2.0 / (HC * D) ** 0.5)
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    base = torch.randn(mix, generator=g) * 0.5
    w = torch.rand(D, generator=g) + 0.5
    return [t.to(dev) for t in (h.bfloat16(), fn, scale, base, w)]


def pre_f64(h, fn, scale, base):
    """post and comb from exact (float64) mixes."""
    xf = h.flatten(-2).double()
    mixes = (xf @ fn.double().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    _, post, comb = ops.sinkhorn_mixes(mixes, scale.double(), base.double(), HC, ITERS, HC_EPS)
    return post, comb


def check_pre(args, cfg=None):
    h, fn, scale, base, w = args
    x, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
    xr, pr, cr = mhc_pre_ref(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    p64, c64 = pre_f64(h, fn, scale, base)
    check_f32(post, pr, p64)
    check_f32(comb, cr, c64)
    check_bf16(x, xr, max_steps=2)  # bf16 collapse, then the norm's rounding
    return x, post, comb


SMALL = [MhcConfig(32, 2, 16, 16, 4, 2, False), MhcConfig(64, 4, 32, 64, 2, 1, True), MhcConfig(16, 1, 64, 16, 1, 8, True)]


def picked_configs():
    return sorted({mhc.pick_config(HC, D) for D in (4096, 40, 300)} | set(mhc._PINNED.values()), key=str)


@pytest.mark.parametrize("cfg", picked_configs() + SMALL, ids=str)
@pytest.mark.parametrize("B,D", [(1, 40), (3, 100), (5, 64)])
def test_pre_head_post_match_ref(cfg, B, D):
    args = make(B, D, seed=B * 100 + D + cfg.kc)
    x, post, comb = check_pre(args, cfg)
    h = args[0]
    y = (torch.randn(B, D, device=DEV) * 3).bfloat16()
    out = mhc_post(y, h, post, comb, config=cfg)
    assert torch.equal(out.float(), mhc_post_ref(y, h, post, comb).float())
    hh, fn, scale, base, w = make(B, D, seed=B + D, head=True)
    check_bf16(mhc_head(hh, fn, scale, base, w, HC_EPS, EPS, config=cfg), mhc_head_ref(hh, fn, scale, base, w, HC_EPS, EPS), max_steps=2)


def test_v4_width_on_cpu():
    """D = 4096 with the pinned configuration (S = 64 mixes programs, two D chunks)."""
    args = make(2, 4096, seed=7)
    check_pre(args)
    h = args[0]
    post = torch.rand(2, HC, device=DEV) * 2
    comb = torch.rand(2, HC, HC, device=DEV)
    y = torch.randn(2, 4096, device=DEV).bfloat16()
    assert torch.equal(mhc_post(y, h, post, comb).float(), mhc_post_ref(y, h, post, comb).float())


def test_expanded_streams_and_fp32_y():
    """The embedding step passes h as one row expanded over the streams (stride 0)."""
    h, fn, scale, base, w = make(3, 96, seed=3)
    he = h[:, :1].expand(-1, HC, -1)
    check_pre([he, fn, scale, base, w], MhcConfig(32, 2, 32, 32, 4))
    post, comb = torch.rand(3, HC, device=DEV), torch.rand(3, HC, HC, device=DEV)
    y = torch.randn(3, 96, device=DEV)
    assert torch.equal(mhc_post(y, he, post, comb).float(), mhc_post_ref(y, he, post, comb).float())


@pytest.mark.parametrize("cfg", [None, MhcConfig(32, 2, 16, 16, 4)], ids=str)
def test_batch_invariant_and_deterministic(cfg):
    h, fn, scale, base, w = make(6, 72, seed=11)
    full = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
    again = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    for rows in (slice(0, 1), slice(5, 6), slice(1, 6)):
        part = mhc_pre(h[rows], fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows])
    y = torch.randn(6, 72, device=DEV).bfloat16()
    o = mhc_post(y, h, full[1], full[2], config=cfg)
    assert torch.equal(mhc_post(y[5:6], h[5:6], full[1][5:6], full[2][5:6], config=cfg), o[5:6])
    hh, fn4, s4, b4, w4 = make(6, 72, seed=12, head=True)
    z = mhc_head(hh, fn4, s4, b4, w4, HC_EPS, EPS, config=cfg)
    assert torch.equal(z, mhc_head(hh, fn4, s4, b4, w4, HC_EPS, EPS, config=cfg))
    assert torch.equal(mhc_head(hh[:1], fn4, s4, b4, w4, HC_EPS, EPS, config=cfg), z[:1])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (torch.equal alone takes -0.0 for +0.0)."""
    iv = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(iv[a.dtype]), b.view(iv[b.dtype]))


def run_all(args, head_args, y, cfg):
    """(x, post, comb) of mhc_pre, z of mhc_head and mhc_post's output under cfg."""
    h, fn, scale, base, w = args
    x, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
    z = mhc_head(*head_args, HC_EPS, EPS, config=cfg)
    return x, post, comb, z, mhc_post(y, h, post, comb, config=cfg)


def finish_variants(base: MhcConfig, D: int) -> list[MhcConfig]:
    """Configurations that must give base's bits: only the finish, block_m or post_block_d differ."""
    dp = max(16, 1 << (D - 1).bit_length())
    out = [replace(base, block_d=bd) for bd in (16, 64, dp) if bd != base.block_d]
    out += [replace(base, finish_warps=fw, sinkhorn_apart=ap) for fw, ap in ((1, True), (2, False), (8, True))]
    out += [replace(base, block_m=2 * base.block_m, post_block_d=max(16, base.post_block_d // 2))]
    out += [replace(base, sinkhorn_scalar=True), replace(base, sinkhorn_scalar=True, sinkhorn_apart=False)]
    return out


@pytest.mark.parametrize("B,D", [(3, 300), (2, 64)])
def test_finish_variants_same_bits(B, D):
    """A one-pass row (block_d >= D) and chunked rows (block_d 16, 64) give the same sum of squares,
    and neither the warps nor the Sinkhorn's own program change a bit."""
    base = MhcConfig(64, 2, 32, 32, 4, 4, True)
    args = make(B, D, seed=D + B)
    head_args = make(B, D, seed=D + B + 1, head=True)
    y = (torch.randn(B, D, device=DEV) * 3).bfloat16()
    ref = run_all(args, head_args, y, base)
    check_pre(args, base)
    for cfg in finish_variants(base, D):
        for a, b in zip(run_all(args, head_args, y, cfg), ref):
            assert same_bits(a, b), cfg


def test_ops_sums_over_streams_in_order():
    """The kernels sum over streams j = 0..hc-1 sequentially: that is torch's order here."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(8, HC, 257, generator=g)
    assert torch.equal(t.sum(-2), ((t[:, 0] + t[:, 1]) + t[:, 2]) + t[:, 3])
    c = torch.randn(8, HC, HC, generator=g)
    assert torch.equal(c.sum(-1), ((c[..., 0] + c[..., 1]) + c[..., 2]) + c[..., 3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 4, 64])
def test_gpu_v4_shapes(B):
    args = make(B, 4096, seed=B, dev="cuda")
    x, post, comb = check_pre(args)
    h, fn, scale, base, w = args
    again = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    one = mhc_pre(h[:1], fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    for a, b, c in zip((x, post, comb), again, one):
        assert torch.equal(a, b) and torch.equal(a[:1], c)
    y = torch.randn(B, 4096, device="cuda").bfloat16()
    o = mhc_post(y, h, post, comb)
    check_bf16(o, mhc_post_ref(y, h, post, comb), min_equal=0.999)
    assert torch.equal(o, mhc_post(y, h, post, comb))
    hh, fn4, s4, b4, w4 = make(B, 4096, seed=B + 1, head=True, dev="cuda")
    z = mhc_head(hh, fn4, s4, b4, w4, HC_EPS, EPS)
    check_bf16(z, mhc_head_ref(hh, fn4, s4, b4, w4, HC_EPS, EPS), max_steps=2)
    assert torch.equal(z[:1], mhc_head(hh[:1], fn4, s4, b4, w4, HC_EPS, EPS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_finish_variants_same_bits(B):
    """The fixed sum trees hold on the GPU: other warps / layouts / chunkings, the same bits."""
    base = mhc.pick_config(HC, 4096)
    args = make(B, 4096, seed=B + 5, dev="cuda")
    head_args = make(B, 4096, seed=B + 6, head=True, dev="cuda")
    y = (torch.randn(B, 4096, device="cuda") * 3).bfloat16()
    ref = run_all(args, head_args, y, base)
    for cfg in finish_variants(base, 4096) + [replace(base, block_d=1024, finish_warps=1),
                                                replace(base, finish_warps=16, sinkhorn_apart=False)]:
        for a, b in zip(run_all(args, head_args, y, cfg), ref):
            assert same_bits(a, b), cfg


@pytest.mark.parametrize("cfg", [None] + SMALL, ids=str)
@pytest.mark.parametrize("B,D", [(1, 64), (3, 40), (5, 128)])
def test_post_pre_fused_equals_post_then_pre(cfg, B, D):
    """mhc_post_pre gives the bits of mhc_post followed by mhc_pre (bf16 and fp32 y), and matches
    the refs like the two calls do."""
    h, fn, scale, base, w = make(B, D, seed=B * 100 + D)
    g = torch.Generator(device="cpu").manual_seed(D)
    _, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
    for y in ((torch.randn(B, D, generator=g) * 3).bfloat16().to(DEV), torch.randn(B, D, generator=g).to(DEV)):
        h2 = mhc_post(y, h, post, comb, config=cfg)
        want = (h2, *mhc_pre(h2, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg))
        got = mhc.mhc_post_pre(y, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                      b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
        ref = mhc.mhc_post_pre_ref(y, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
        check_bf16(got[0], ref[0], max_steps=0)


@pytest.mark.parametrize("B,D", [(1, 64), (3, 40)])
def test_second_addend_is_the_residual_sum(B, D):
    """y2 (FastDecoder's shared_w2 "mhc"): mhc_post and mhc_post_pre with an fp32 y and a bf16 y2
    give the bits of the same calls on rnd(y + y2), the sum linear_fp8's residual epilogue makes;
    the refs too. (y2's magnitude near y's: the rounding of the sum matters.)"""
    h, fn, scale, base, w = make(B, D, seed=B * 7 + D)
    g = torch.Generator(device="cpu").manual_seed(B + D)
    _, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    y = (torch.randn(B, D, generator=g) * 3).to(DEV)
    y2 = (torch.randn(B, D, generator=g) * 3).bfloat16().to(DEV)
    summed = (y + y2.float()).bfloat16()
    assert not torch.equal(summed.float(), y + y2.float())  # the sum does round
    assert torch.equal(mhc_post(y, h, post, comb, y2=y2), mhc_post(summed, h, post, comb))
    got = mhc.mhc_post_pre(y, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, y2=y2)
    want = mhc.mhc_post_pre(summed, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ref = mhc.mhc_post_pre_ref(y, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, y2=y2)
    check_bf16(got[0], ref[0], max_steps=0)
    with pytest.raises(AssertionError):  # y2 needs the fp32 sum beside it
        mhc_post(summed, h, post, comb, y2=y2)


@pytest.mark.parametrize("S", [1, 3, 8])
@pytest.mark.parametrize("B,D", [(1, 64), (3, 40)])
def test_split_partials_are_summed_in_order(S, B, D):
    """y [S, B, D] fp32 (FastDecoder's WO_B_PARTS_ROWS: wo_b's split-K partials): mhc_post and
    mhc_post_pre give the bits of the same calls on the partials summed in split order and rounded to
    bf16 (split_combine.sum_splits_ref, linear_fp8's combine), and the refs take them too. A large first partial that
    the second nearly cancels makes the order matter; a strided view (split stride not B D) too."""
    h, fn, scale, base, w = make(B, D, seed=B * 11 + D + S)
    g = torch.Generator(device="cpu").manual_seed(B + D + S)
    _, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    parts = torch.randn(S, B, D + 8, generator=g)
    if S > 1:
        big = torch.randn(B, D + 8, generator=g) * 1e6
        parts[0] += big
        parts[1] -= big
    parts = parts.to(DEV)[:, :, :D]
    summed = sum_splits_ref(parts)
    if S > 2:  # the order matters for these partials: not every permutation gives the same bits
        assert not torch.equal(summed, sum_splits_ref(parts.flip(0)))
    assert torch.equal(mhc_post(parts, h, post, comb), mhc_post(summed, h, post, comb))
    got = mhc.mhc_post_pre(parts, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    want = mhc.mhc_post_pre(summed, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ref = mhc.mhc_post_pre_ref(parts, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    check_bf16(got[0], ref[0], max_steps=0)
    with pytest.raises(AssertionError):  # partials stand alone (no second addend)
        mhc_post(parts, h, post, comb, y2=summed)


@pytest.mark.parametrize("B,D", [(1, 64), (3, 40)])
def test_expert_pairs_are_summed_in_slot_order_then_the_shared_output(B, D):
    """y [k, B, D] bf16 with y2 (FastDecoder's MOE_PAIRS_ROWS: the routed experts' per-slot outputs as a
    transposed view of [B, k, D]): mhc_post and mhc_post_pre give the bits of the same calls on the slot-order
    fp32 sum (moe.sum_pairs) with the same y2, i.e. rnd(sum + y2); the refs too."""
    from megastep.kernels import moe

    h, fn, scale, base, w = make(B, D, seed=B * 13 + D)
    g = torch.Generator(device="cpu").manual_seed(B * D)
    _, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    pairs = (torch.randn(B, 6, D, generator=g) * 3).bfloat16()
    pairs[:, 0] += 2.0**30
    pairs[:, 1] -= 2.0**30  # the slot order shows in the fp32 sum
    pairs = pairs.to(DEV)
    y2 = (torch.randn(B, D, generator=g) * 3).bfloat16().to(DEV)
    summed = moe.sum_pairs(pairs)
    assert not torch.equal(summed, moe.sum_pairs(pairs.flip(1)))
    view = pairs.transpose(0, 1)
    assert torch.equal(mhc_post(view, h, post, comb, y2=y2), mhc_post(summed, h, post, comb, y2=y2))
    got = mhc.mhc_post_pre(view, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, y2=y2)
    want = mhc.mhc_post_pre(summed, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, y2=y2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ref = mhc.mhc_post_pre_ref(view, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, y2=y2)
    check_bf16(got[0], ref[0], max_steps=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 16, 64])
def test_gpu_post_pre_fused_same_bits(B):
    """At V4 shapes on the GPU, where the mixes kernel contracts FMAs: the fused launch gives the
    bits of mhc_post then mhc_pre (its post products are rounded on their own, like the post
    kernel's, compiled without FP fusion)."""
    h, fn, scale, base, w = make(B, 4096, seed=B + 9, dev="cuda")
    _, post, comb = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    y = (torch.randn(B, 4096, device="cuda") * 3).bfloat16()
    h2 = mhc_post(y, h, post, comb)
    want = (h2, *mhc_pre(h2, fn, scale, base, w, HC, ITERS, HC_EPS, EPS))
    got = mhc.mhc_post_pre(y, h, post, comb, fn, scale, base, w, HC, ITERS, HC_EPS, EPS)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def sinkhorn_elsewhere(args, y, cfg, where):
    """mhc_pre and mhc_post_pre with the Sinkhorn launched `where` (mhc_pre's sinkhorn_stream),
    the caller's stream joined before the outputs are read."""
    h, fn, scale, base, w = args
    pre = mhc_pre(h, fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg, sinkhorn_stream=where)
    fused = mhc.mhc_post_pre(y, h, pre[1], pre[2], fn, scale, base, w, HC, ITERS, HC_EPS, EPS, config=cfg,
                             sinkhorn_stream=where)
    if isinstance(where, torch.cuda.Stream):
        torch.cuda.current_stream().wait_stream(where)
    return (*pre, *fused)


@pytest.mark.parametrize("cfg", [None, MhcConfig(64, 2, 32, 32, 4, 2, False)], ids=str)
@pytest.mark.parametrize("B,D", [(1, 64), (3, 300)])
def test_sinkhorn_in_its_own_launch_same_bits(cfg, B, D):
    """The Sinkhorn programs launched apart from the collapse (mhc.CURRENT_STREAM) give the bits of
    the one finish launch, with the Sinkhorn beside or before the collapse (sinkhorn_apart)."""
    args = make(B, D, seed=B + D + 3)
    y = (torch.randn(B, D, generator=torch.Generator().manual_seed(B)) * 3).bfloat16().to(DEV)
    one = sinkhorn_elsewhere(args, y, cfg, None)
    for a, b in zip(sinkhorn_elsewhere(args, y, cfg, mhc.CURRENT_STREAM), one):
        assert same_bits(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_sinkhorn_on_another_stream_same_bits(B):
    """At V4 shapes, the Sinkhorn on a second stream (FastDecoder's MHC_SINKHORN_BESIDE_ROWS): the
    bits of the one finish launch."""
    args = make(B, 4096, seed=B + 21, dev="cuda")
    y = (torch.randn(B, 4096, device="cuda") * 3).bfloat16()
    one = sinkhorn_elsewhere(args, y, None, None)
    for a, b in zip(sinkhorn_elsewhere(args, y, None, torch.cuda.Stream()), one):
        assert same_bits(a, b)
