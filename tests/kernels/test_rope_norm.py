"""rope_norm kernels against their refs (model/ops.py itself): random inputs at tiny shapes (head
dim 64 with 16 RoPE dims, a ragged fp8 block), both RoPE forms (inverse frequencies; the table),
bf16 and fp32 activations, padding rows on the dummy slot, batch invariance and determinism;
the in-kernel Hadamard, fp4 scale and e2m1 rounding value by value.

Tolerances (why): the kernels round at exactly the points ops rounds; they differ only in the
fp32 order of sums (sum of squares, Hadamard butterflies) and in cos/sin, which the interpreter
computes in float64 rounded to fp32 against torch-CPU's SLEEF (<= 1 ulp; `test_cos_sin_ulps`).
Either can move an fp32 value by an ulp and, rarely, a bf16 rounding by one step (and through it
an fp8/fp4 rounding by one grid step). So outputs must be bit-equal in >= 99% of the elements
and the rest within one such step; with the RoPE table (same cos/sin as torch) the observed
results are bit-equal, and the tests say so where they require it.
"""

import importlib
import os
import sys

import pytest
import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.rope_norm" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.rope_norm"])  # imported before the interpreter was set

from megastep.checkpoint import formats as F  # noqa: E402
from megastep.config import ModelConfig  # noqa: E402
from megastep.kernels import rope_norm as rn  # noqa: E402
from megastep.kernels.common import on_interpreter  # noqa: E402
from megastep.model import ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
POS = [0, 1, 7, 127, 4095, 65537, 1048575]


def inv_freq(rd: int, compressed: bool) -> torch.Tensor:
    return ops.rope_inv_freq(ModelConfig().replace(qk_rope_head_dim=rd), compressed)


def ropes(rd: int, dev=DEV):
    """Both RoPE forms for both layer kinds; the table covers every test position."""
    out = []
    for c in (False, True):
        f = inv_freq(rd, c).to(dev)
        out += [(f"freq{int(c)}", f)]
    return out + [("table", rn.rope_table(inv_freq(rd, True).to(dev), POS[4] + 1))]


def positions(B: int, seed: int, table: bool, dev=DEV) -> torch.Tensor:
    pool = POS[:5] if table else POS
    g = torch.Generator().manual_seed(seed)
    return torch.tensor(pool, dtype=torch.int64)[torch.randint(0, len(pool), (B,), generator=g)].to(dev)


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable steps of the (common) dtype, sign-aware."""
    assert a.dtype == b.dtype and a.shape == b.shape
    it = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    ia, ib = (t.contiguous().view(it).long() for t in (a, b))
    m = 0x7FFF if it == torch.int16 else 0x7FFFFFFF
    ia = torch.where(ia < 0, -(ia & m), ia)
    ib = torch.where(ib < 0, -(ib & m), ib)
    return (ia - ib).abs()


def check(y, ref, *, grid_step: float = 0.0, min_equal: float = 0.99, exact: bool = False):
    """bf16: bit-equal values (+-0 equal) in >= min_equal of the elements, the others at most one
    bf16 step, or one quantization-grid step (grid_step * |ref| relative) where the values went
    through an fp8/fp4 simulation. fp32 (nothing rounds the sum-order noise away): every element
    within 4 ulps, 2e-6 of the largest value, or one grid step."""
    y, ref = y.cpu(), ref.cpu()
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y.float()).all()
    neq = y.float() != ref.float()
    if exact:
        assert not neq.any(), f"{neq.sum().item()} of {y.numel()} elements differ"
        return
    if y.dtype == torch.bfloat16:
        assert neq.sum().item() <= max(2, (1 - min_equal) * y.numel()), f"{neq.sum().item()} of {y.numel()} differ"
    if neq.any():
        near = steps_apart(y, ref) <= (1 if y.dtype == torch.bfloat16 else 4)
        diff = (y.float() - ref.float()).abs()
        near |= diff <= grid_step * ref.float().abs().clamp_min(1e-30) * 2
        if y.dtype == torch.float32:  # RoPE's a*cos - b*sin may cancel: ulps of the row's scale
            near |= diff <= 2e-6 * ref.abs().max()
        bad = neq & ~near
        assert not bad.any(), (y[bad], ref[bad])


def rand(shape, seed, dtype=torch.bfloat16, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    # rows and channels of different magnitudes (never zeros)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape[:-1] + (1,), generator=g).float())
    return x.to(dtype).to(dev)


# ---- rms_norm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,D", [(1, 64), (3, 96), (2, 1024)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(dtype, B, D, weighted):
    x = rand((B, D), seed=B * D, dtype=dtype)
    w = (torch.rand(D, generator=torch.Generator().manual_seed(D)) + 0.5).to(DEV) if weighted else None
    y = rn.rms_norm(x, w, EPS)
    check(y, rn.rms_norm_ref(x, w, EPS))
    assert torch.equal(y, rn.rms_norm(x, w, EPS))
    assert torch.equal(y[-1:], rn.rms_norm(x[-1:], w, EPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,D", [(1, 256), (3, 300)])
def test_rms_norm_codes_are_the_outputs_quantization(dtype, B, D):
    """codes=True: the same output, and beside it the output's fp8 activation quantization: the
    codes times their per-128 scales are fp8_act_sim of the output (a ragged last block on its own
    amax), the codes the e4m3 values of fp8_act_quant."""
    x = rand((B, D), seed=B + D, dtype=dtype)
    w = (torch.rand(D, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEV)
    y, (c, s) = rn.rms_norm(x, w, EPS, codes=True)
    assert torch.equal(y, rn.rms_norm(x, w, EPS))
    assert c.shape == (B, D) and s.shape == (B, -(-D // 128))
    deq = (c.float().view(B, -1) * s.repeat_interleave(128, 1)[:, :D])
    assert torch.equal(deq, F.fp8_act_sim(y.float(), 128))
    pad = torch.nn.functional.pad(y.float(), (0, -D % 128))
    q, qs = F.fp8_act_quant(pad, 128)
    assert torch.equal(c.view(torch.uint8), q[:, :D].view(torch.uint8)) and torch.equal(s, qs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [32, 300, 1024])
def test_rms_norm_sums_its_squares_exactly(dtype, D):
    """rms_norm's sum of squares is exact (whole units of the row, summed in fp64): the kernel gives
    rms_norm_exact_ref's bits (rsqrt aside on the GPU), the same bits for its channels in any order,
    and the sum is float64's, rounded once (on these rows). Rows: 30 binades of magnitudes, zeros,
    one huge value."""
    g = torch.Generator().manual_seed(D)
    x = torch.randn(5, D, generator=g) * torch.exp2(torch.randint(-15, 15, (5, D), generator=g).float())
    x[1] = 0
    x[2, :] = x[2, :].sign() * 2.0**-20
    x[2, 3] = 2.0**40
    x = x.to(dtype).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    y = rn.rms_norm(x, w, EPS)
    assert torch.isfinite(y).all()
    if on_interpreter(x):
        assert torch.equal(y, rn.rms_norm_exact_ref(x, w, EPS))
    else:
        check(y, rn.rms_norm_exact_ref(x, w, EPS))
    perm = torch.randperm(D, generator=g).to(DEV)
    assert torch.equal(rn.rms_norm(x[:, perm].contiguous(), w[perm].contiguous(), EPS), y[:, perm])
    ss = rn.sumsq_exact_ref(x.cpu())
    true = (x.cpu().double() ** 2).sum(-1) if dtype == torch.bfloat16 else (x.cpu() * x.cpu()).double().sum(-1)
    assert torch.equal(ss, true.float())  # bf16 squares are exact in fp32; fp32 ones rounded first


# ---- q_norm_rope ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,H,cfg", [(1, 4, None), (3, 5, rn.HeadsConfig(2, 2))])
def test_q_norm_rope(dtype, B, H, cfg):
    for i, (name, rope) in enumerate(ropes(16)):
        pos = positions(B, seed=i, table=name == "table")
        q = rand((B, H, 64), seed=B * 10 + H + i, dtype=dtype)
        y = rn.q_norm_rope(q, rope, pos, EPS, config=cfg)
        check(y, rn.q_norm_rope_ref(q, rope, pos, EPS))
        if name == "table" and dtype == torch.bfloat16:  # same cos/sin: only the sum order may differ
            check(y, rn.q_norm_rope_ref(q, rope, pos, EPS), exact=True)


def test_q_norm_rope_invariance():
    rope = inv_freq(16, True).to(DEV)
    q = rand((6, 5, 64), seed=3)
    pos = positions(6, seed=3, table=False)
    for cfg in (None, rn.HeadsConfig(2, 2)):
        y = rn.q_norm_rope(q, rope, pos, EPS, config=cfg)
        assert torch.equal(y, rn.q_norm_rope(q, rope, pos, EPS, config=cfg))
        assert torch.equal(y[4:5], rn.q_norm_rope(q[4:5], rope, pos[4:5], EPS, config=cfg))
    # heads are independent: a config change may not change a bit
    assert torch.equal(rn.q_norm_rope(q, rope, pos, EPS), rn.q_norm_rope(q, rope, pos, EPS, config=rn.HeadsConfig(1, 1)))


# ---- kv_rope_sim_store ------------------------------------------------------------------------------
def window_case(B, dtype, seed, W=16, S=5):
    g = torch.Generator().manual_seed(seed)
    kv = rand((B, 64), seed=seed, dtype=dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(DEV)
    win = rand((S, W, 64), seed=seed + 1, dtype=dtype)  # a used pool: other entries must survive
    dummy = S - 1
    slots = torch.randperm(S - 1, generator=g)[:B]
    if B > 2:
        slots[-1] = dummy  # a padding row
    return kv, w, win, slots.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 3])
def test_kv_rope_sim_store(dtype, B):
    for i, (name, rope) in enumerate(ropes(16)):
        kv, w, win, slots = window_case(B, dtype, seed=B + 7 * i)
        pos = positions(B, seed=i + 20, table=name == "table")
        win_ref = win.clone()
        y = rn.kv_rope_sim_store(kv, w, rope, pos, win, slots, EPS, nope=48)
        ref = rn.kv_rope_sim_store_ref(kv, w, rope, pos, win_ref, slots, EPS, nope=48)
        check(y, ref, grid_step=2.0**-3)
        check(win, win_ref, grid_step=2.0**-3)
        assert torch.equal(win[slots, pos % win.shape[1]], y)
        if name == "table" and dtype == torch.bfloat16:
            check(y, ref, exact=True)


def test_kv_rope_sim_store_invariance():
    rope = inv_freq(16, False).to(DEV)
    kv, w, win, slots = window_case(4, torch.bfloat16, seed=5, S=6)
    pos = positions(4, seed=5, table=False)
    y = rn.kv_rope_sim_store(kv, w, rope, pos, win, slots, EPS, 48)
    assert torch.equal(y, rn.kv_rope_sim_store(kv, w, rope, pos, win.clone(), slots, EPS, 48))
    one = rn.kv_rope_sim_store(kv[2:3], w, rope, pos[2:3], win.clone(), slots[2:3], EPS, 48)
    assert torch.equal(one, y[2:3])


def test_kv_sim_blocks_at_v4_width():
    """hd 512 / rope 64: seven full fp8 blocks; one row per position kind."""
    rope = inv_freq(64, False).to(DEV)
    kv = rand((3, 512), seed=9)
    w = (torch.rand(512, generator=torch.Generator().manual_seed(9)) + 0.5).to(DEV)
    win = torch.zeros(4, 128, 512, dtype=torch.bfloat16, device=DEV)
    win_ref = win.clone()
    slots = torch.tensor([0, 3, 1], device=DEV)
    pos = torch.tensor([0, 200, 70000], device=DEV)
    y = rn.kv_rope_sim_store(kv, w, rope, pos, win, slots, EPS, 448)
    check(y, rn.kv_rope_sim_store_ref(kv, w, rope, pos, win_ref, slots, EPS, 448), grid_step=2.0**-3)
    check(win, win_ref, grid_step=2.0**-3)


# ---- indexer_q ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,H,d,cfg", [(1, 4, 64, None), (3, 3, 128, rn.HeadsConfig(2, 2))])
def test_indexer_q(B, H, d, cfg):
    for i, (name, rope) in enumerate(ropes(d // 2)):
        pos = positions(B, seed=i + 40, table=name == "table")
        q = rand((B, H, d), seed=B + H + d + i)
        y = rn.indexer_q(q, rope, pos, config=cfg)
        # one fp4 step at most where a bf16 rounding before the simulation moved (see module doc)
        check(y, rn.indexer_q_ref(q, rope, pos), grid_step=0.5)
    y = rn.indexer_q(q, rope, pos, config=cfg)
    assert torch.equal(y, rn.indexer_q(q, rope, pos))
    assert torch.equal(y[-1:], rn.indexer_q(q[-1:], rope, pos[-1:]))


@triton.jit
def _hadamard_sim_kernel(x_ptr, h_ptr, q_ptr, R: tl.constexpr, HALF: tl.constexpr, LOG_HALF: tl.constexpr,
                         INTERPRET: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    p = tl.arange(0, HALF)[None, :]
    e = tl.load(x_ptr + r * 2 * HALF + 2 * p)
    o = tl.load(x_ptr + r * 2 * HALF + 2 * p + 1)
    he, ho = rn.hadamard_pairs(e, o, R, HALF, LOG_HALF)
    tl.store(h_ptr + r * 2 * HALF + 2 * p, he)
    tl.store(h_ptr + r * 2 * HALF + 2 * p + 1, ho)
    qe, qo = rn.fp4_sim_pairs(e, o, p, HALF)  # the simulation alone, on the raw input
    tl.store(q_ptr + r * 2 * HALF + 2 * p, qe)
    tl.store(q_ptr + r * 2 * HALF + 2 * p + 1, qo)


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_and_fp4_sim_pieces(n):
    """Butterflies vs formats.hadamard_rotate's matmul (fp32; before the bf16 rounding): equal up
    to the fp32 order of the n-term sums; after the bf16 rounding ops applies, how many elements
    differ is counted (0 here). fp4 simulation: bit-exact, including every e2m1 midpoint (ties to
    even), -0.0, tiny and huge blocks."""
    R = 64
    x = rand((R, n), seed=n).float()  # bf16 values, as the kernels see them
    h = torch.empty(R, n, device=DEV)
    q = torch.empty(R, n, device=DEV)
    _hadamard_sim_kernel[(1,)](x, h, q, R=R, HALF=n // 2, LOG_HALF=(n // 2).bit_length() - 1, INTERPRET=on_interpreter(x))
    exact = (x.cpu().double() @ F.hadamard_matrix(n).double()) * n**-0.5
    ref32 = (x.cpu() @ F.hadamard_matrix(n)) * n**-0.5
    err, ref_err = (h.cpu().double() - exact).abs().max().item(), (ref32.double() - exact).abs().max().item()
    assert err <= 2 * ref_err + 1e-7, (err, ref_err)
    assert torch.equal(h.cpu().bfloat16(), rn.hadamard_ref(x.cpu().bfloat16())), "bf16-rounded Hadamard differs"
    if n >= 32:
        assert torch.equal(q.cpu(), F.fp4_act_sim(x.cpu(), 32))
        # e2m1 grid points and midpoints at several block scales, signed; a -0.0 and a tiny block
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        vals = torch.cat([grid, mids, -grid, -mids, torch.tensor([6.0, -0.0, 1e-3, 5.99, 0.26, 0.74])])
        blk = vals[:32].repeat(R * n // 32).view(R, n)
        blk = blk * torch.exp2(torch.randint(-20, 20, (R, n // 32), generator=torch.Generator().manual_seed(1))
                               ).repeat_interleave(32, 1)
        blk[0, :32] = 1e-40  # below the 6 * 2^-126 floor
        q2 = torch.empty(R, n, device=DEV)
        _hadamard_sim_kernel[(1,)](blk.to(DEV), h, q2, R=R, HALF=n // 2, LOG_HALF=(n // 2).bit_length() - 1,
                                   INTERPRET=on_interpreter(x))
        want = F.fp4_act_sim(blk, 32)
        assert torch.equal(q2.cpu(), want)
        assert torch.equal(torch.signbit(q2.cpu()), torch.signbit(want))


@triton.jit
def _cos_sin_kernel(a_ptr, c_ptr, s_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):
    o = tl.arange(0, N)
    a = tl.load(a_ptr + o)
    tl.store(c_ptr + o, rn.t_cos(a, INTERPRET))
    tl.store(s_ptr + o, rn.t_sin(a, INTERPRET))


def test_cos_sin_ulps():
    """The kernels' cos/sin against torch's on the RoPE angles of both layer kinds: at most one
    fp32 ulp apart; on the interpreter (float64 rounded, vs SLEEF) ~4% of them differ, on the GPU
    libdevice is expected to equal torch's CUDA cosf/sinf (printed, not required)."""
    pos = torch.arange(0, 1 << 20, 997, dtype=torch.float32)
    ang = torch.cat([(pos[:, None] * inv_freq(64, c)).flatten() for c in (False, True)]).to(DEV)
    n = triton.next_power_of_2(ang.numel())
    a = torch.zeros(n, device=DEV)
    a[: ang.numel()] = ang
    c, s = torch.empty_like(a), torch.empty_like(a)
    _cos_sin_kernel[(1,)](a, c, s, N=n, INTERPRET=on_interpreter(a))
    for got, want in ((c, a.cos()), (s, a.sin())):
        d = steps_apart(got.cpu(), want.cpu())
        assert d.max().item() <= 1, d.max().item()
        frac = (d > 0).float().mean().item()
        print(f"cos/sin: {frac:.2%} one ulp off torch")
        assert frac < (0.10 if on_interpreter(a) else 0.01)


def test_v4_widths_on_cpu():
    """The V4-Flash head shapes with the pinned configurations: q [64 x 512], indexer q [64 x 128]."""
    rope = inv_freq(64, True).to(DEV)
    pos = torch.tensor([5, 70001], device=DEV)
    q = rand((2, 64, 512), seed=31)
    check(rn.q_norm_rope(q, rope, pos, EPS), rn.q_norm_rope_ref(q, rope, pos, EPS), min_equal=0.999)
    qi = rand((2, 64, 128), seed=32)
    check(rn.indexer_q(qi, rope, pos), rn.indexer_q_ref(qi, rope, pos), grid_step=0.5, min_equal=0.999)


# ---- GPU, real shapes -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 7, 64])
def test_gpu_v4_shapes(B):
    dev = "cuda"
    for compressed in (False, True):
        f = inv_freq(64, compressed).to(dev)
        pos = torch.randint(0, 1 << 20, (B,), device=dev)
        x = rand((B, 1024), seed=B, dev=dev)
        w = (torch.rand(1024, device=dev) + 0.5)
        y = rn.rms_norm(x, w, EPS)
        check(y, rn.rms_norm_ref(x, w, EPS), min_equal=0.999)
        assert torch.equal(y[:1], rn.rms_norm(x[:1], w, EPS))
        q = rand((B, 64, 512), seed=B + 1, dev=dev)
        y = rn.q_norm_rope(q, f, pos, EPS)
        check(y, rn.q_norm_rope_ref(q, f, pos, EPS), min_equal=0.999)
        assert torch.equal(y, rn.q_norm_rope(q, f, pos, EPS)) and torch.equal(y[:1], rn.q_norm_rope(q[:1], f, pos[:1], EPS))
        kv = rand((B, 512), seed=B + 2, dev=dev)
        win = torch.zeros(B + 1, 128, 512, dtype=torch.bfloat16, device=dev)
        win_ref = win.clone()
        slots = torch.randperm(B + 1, device=dev)[:B]
        y = rn.kv_rope_sim_store(kv, w[:512].contiguous(), f, pos, win, slots, EPS, 448)
        check(y, rn.kv_rope_sim_store_ref(kv, w[:512].contiguous(), f, pos, win_ref, slots, EPS, 448), grid_step=2.0**-3,
              min_equal=0.999)
        check(win, win_ref, grid_step=2.0**-3, min_equal=0.999)
        qi = rand((B, 64, 128), seed=B + 3, dev=dev)
        y = rn.indexer_q(qi, f, pos)
        check(y, rn.indexer_q_ref(qi, f, pos), grid_step=0.5, min_equal=0.995)
        assert torch.equal(y, rn.indexer_q(qi, f, pos)) and torch.equal(y[:1], rn.indexer_q(qi[:1], f, pos[:1]))


# ---- the heads kernels' configurations at V4-Flash width (GPU) ------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_heads_configs_change_no_bit(B):
    """At V4 width (64 heads of 512 for q, of 128 for the indexer) every heads configuration gives the
    pinned one's bits: a head's sums never span programs, and the layout of one head's 256 pairs
    over a program's threads must not change them either (what a pin change, say for one row,
    relies on; the step measured them in docs/PERFORMANCE.md's eighteenth measurement)."""
    rope = rn.rope_table(inv_freq(64, True).to("cuda"), POS[4] + 1)
    pos = positions(B, seed=B, table=True, dev="cuda")
    for H, d, fn in ((64, 512, rn.q_norm_rope), (64, 128, rn.indexer_q)):
        q = rand((B, H, d), seed=B + d, dev="cuda")
        args = (q, rope, pos, EPS) if fn is rn.q_norm_rope else (q, rope, pos)
        want = fn(*args)
        for cfg in (rn.HeadsConfig(1, 1), rn.HeadsConfig(1, 4), rn.HeadsConfig(2, 2), rn.HeadsConfig(4, 4),
                    rn.HeadsConfig(8, 4), rn.HeadsConfig(16, 4)):
            assert torch.equal(fn(*args, config=cfg), want), (H, d, cfg)
