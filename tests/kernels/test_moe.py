"""moe_experts_mxfp4 / moe_experts_table against moe_experts_mxfp4_ref: routing groups, every mode
("fma", "dot", "dot_asm", "dot_scaled") and pair block, ragged D and I (quantization blocks of 128
that end early), duplicate experts in a row, more pairs of one expert than a pair block, fp32 and
bf16 activations, the stacking of official per-expert tensors; run-to-run bit identity, batch
invariance (a row alone = the same row in a batch, bit for bit) and address tables built from
separate allocations in random memory order (bit-identical to the stacked path).

Tolerance: the kernel multiplies the same exact values as the ref (e2m1 * 2^k times e4m3 * 2^k
is exact in fp32) and differs only in the order of fp32 sums. With bf16 activations the w1/w3
outputs, the SwiGLU activation and each expert output are rounded to bf16 (as the official
Linear outputs are); a sum that sits next to a rounding boundary can land one bf16 step away
and then move one e4m3 step (2^-3 relative) of the re-quantized activation. That is rare and
local: we require rel. L2 error <= 4e-3 and |y - ref| <= 2e-2 * max|ref| elementwise. With fp32
activations there is no rounding point but fp8 quantization: rel. L2 <= 1e-3.
"""

import re

import pytest
import torch

from megastep.checkpoint import formats as F
from megastep.kernels.cuda_module import find_nvcc
from megastep.kernels import moe as MOE
from megastep.kernels.moe import (
    ExpertTable,
    MoeConfig,
    moe_experts_mxfp4,
    moe_experts_mxfp4_ref,
    moe_experts_table,
    moe_route,
    pick_config,
    stack_experts,
    stacked_table,
    sum_pairs,
)

from megastep.kernels.common import workspace  # noqa: E402
from cuda_checks import assert_builds_without_spills, assert_signature_matches  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_experts(E, D, I, seed, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    per = {}
    for e in range(E):
        for name, (n, k) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            w = torch.randn(n, k, generator=g) * 0.05 * torch.exp2(torch.randint(-2, 3, (n, 1), generator=g).float())
            q, s = F.quantize_mxfp4_weight(w)
            per[f"layers.7.ffn.experts.{e}.{name}.weight"] = q
            per[f"layers.7.ffn.experts.{e}.{name}.scale"] = s
    st = stack_experts(per, "layers.7", E)
    return per, {k: v.to(dev) for k, v in st.items()}


def random_stacked_experts(E, D, I, seed, dev, scales=(118, 124)):
    """Stacked experts straight from random bytes (every byte is two valid e2m1 codes); scales
    2^-9..2^-4 keep the SwiGLU inputs around the clamp limit at D = 4096 (a wider range makes the
    fp32 sums round, so that a change of summation order would show)."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rb(*shape):
        return torch.randint(-128, 128, shape, generator=g, device=dev, dtype=torch.int8)

    def sc(*shape):
        return torch.randint(*scales, shape, generator=g, device=dev, dtype=torch.uint8).view(torch.float8_e8m0fnu)

    return {"w13": rb(E, 2 * I, D // 2), "w13_scale": sc(E, 2 * I, D // 32), "w2": rb(E, D, I // 2), "w2_scale": sc(E, D, I // 32)}


def make_inputs(M, D, E, k, seed, dtype=torch.bfloat16, dev=DEV, distinct=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g).float())
    if distinct:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    else:  # hash-layer style tables may repeat an expert within a row
        ids = torch.randint(0, E, (M, k), generator=g)
    wts = torch.rand(M, k, generator=g) + 0.1
    return x.to(dtype).to(dev), ids.to(torch.int32).to(dev), wts.to(dev)


def check(y, ref, bf16=True):
    y, ref = y.cpu(), ref.cpu()
    assert y.dtype == torch.float32 and y.shape == ref.shape and torch.isfinite(y).all()
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel <= (4e-3 if bf16 else 1e-3), rel
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_route_groups_pairs_by_expert():
    g = torch.Generator().manual_seed(3)
    for M, k, E in [(1, 6, 256), (5, 3, 8), (16, 6, 32), (64, 6, 256), (12, 6, 384)]:
        ids = torch.randint(0, E, (M, k), generator=g, dtype=torch.int32)
        pairs, se, ss, sc, ns, _ = (t.cpu() if t is not None else None for t in moe_route(ids.to(DEV), E)[:6])
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        assert torch.equal(pairs, order.int())
        uniq, counts = torch.unique(flat, return_counts=True)
        n = int(ns.item())
        assert n == uniq.numel()
        assert torch.equal(se[:n], uniq.int())
        assert torch.equal(sc[:n], counts.int())
        assert torch.equal(ss[:n], (torch.cumsum(counts, 0) - counts).int())


DOT_MODES = ("dot", "dot_asm", "dot_scaled")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(-g) -> inf, silu -> -0


def configs():
    return [
        MoeConfig(16, 32, 1, 128, 6, 8),  # what pick_config returns for "fma"
        MoeConfig(32, 64, 1, 256, 3, 2),
        MoeConfig(16, 32, 2, 128, 1, 4, num_warps=8),
        MoeConfig(64, 16, 4, 512, 2, 1),
        MoeConfig(128, 128, 1, 128, 4, 1),
    ] + [
        MoeConfig(32, 64, 16, 128, 3, 2, mode=m) for m in DOT_MODES  # what pick_config returns
    ] + [
        MoeConfig(32, 64, 16, 128, 3, 2, num_stages=1, mode="dot_asm"),
        MoeConfig(32, 64, 16, 256, 3, 2, mode="dot_asm"),
        MoeConfig(64, 128, 16, 128, 1, 1, num_warps=8, mode="dot_asm"),
        MoeConfig(16, 16, 16, 512, 2, 3, mode="dot"),
    ]


E, D, I, K = 8, 160, 96, 3  # D = 128 + 32 and I = 96: the last 128-block of each is ragged


@pytest.fixture(scope="module")
def experts():
    return make_experts(E, D, I, seed=11)[1]


def cfg_id(c):
    return f"{c.mode}-i{c.block_i}-d{c.block_d}-p{c.block_p}-k{c.block_k}-g{c.groups_up}.{c.groups_down}-w{c.num_warps}"


@pytest.mark.parametrize("cfg", configs(), ids=cfg_id)
def test_every_config_matches_ref(cfg, experts):
    x, ids, wts = make_inputs(5, D, E, K, seed=cfg.block_i)
    check(moe_experts_mxfp4(x, ids, wts, **experts, config=cfg), moe_experts_mxfp4_ref(x, ids, wts, **experts))


@pytest.mark.parametrize("M", [1, 3, 16])
def test_picked_config_matches_ref(M, experts):
    x, ids, wts = make_inputs(M, D, E, K, seed=M)
    check(moe_experts_mxfp4(x, ids, wts, **experts), moe_experts_mxfp4_ref(x, ids, wts, **experts))


def test_picked_configs_are_tested():
    """Every tile shape pick_config returns, in every mode, is among configs() above (the slot
    groups only change which program handles which expert, not any value), and none of the
    fields that fix a row's summation order depends on M."""
    tested = {(c.mode, c.block_i, c.block_d, c.block_p, c.block_k, c.num_warps) for c in configs()}
    assert pick_config(1, 6, 256, 4096, 2048).mode == MOE.DEFAULT_MODE
    for mode in MOE.MODES:
        for e in (8, 256):
            shapes = set()
            for M in range(1, 65):
                c = pick_config(M, 6, e, 4096, 2048, mode=mode)
                key = (c.mode, c.block_i, c.block_d, c.block_p, c.block_k, c.num_warps)
                assert key in tested, c
                shapes.add((c.mode, c.block_k, c.block_p, c.num_warps, c.num_stages))
            assert len(shapes) == 1, shapes


# ---- the dot modes, the address table, determinism and batch invariance (D = I = 64: the
# ---- interpreter is slow) --------------------------------------------------------------------
E2, D2, I2 = 8, 64, 64


@pytest.fixture(scope="module")
def wide():
    """Random bytes with scales 2^-17..2^2: the fp32 sums round (a changed order would show)."""
    return random_stacked_experts(E2, D2, I2, seed=21, dev=DEV, scales=(110, 130))


def crowded_inputs(M, k, seed, dtype=torch.float32):
    """Rows that repeat experts (within a row and across rows): expert 2 gets more pairs than one
    16-pair block, expert 5 several. fp32 activations by default: no bf16 rounding of the
    expert outputs hides a change in the order of the fp32 sums."""
    x, ids, wts = make_inputs(M, D2, E2, k, seed=seed, dtype=dtype, distinct=False)
    ids[: M - 1, 0] = 2
    ids[: M - 2, 1] = 2
    ids[1::2, 2] = 5
    return x, ids, wts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", list(MOE.MODES))
def test_modes_match_ref_bitwise_repeatable(mode, dtype, wide):
    """Odd M, repeated experts, > 16 pairs of one expert: matches the ref, and a second run
    gives the same bits."""
    x, ids, wts = crowded_inputs(11, 3, seed=5, dtype=dtype)
    assert int((ids == 2).sum()) > 16
    cfg = pick_config(11, 3, E2, D2, I2, mode=mode)
    y1 = moe_experts_mxfp4(x, ids, wts, **wide, config=cfg)
    y2 = moe_experts_mxfp4(x, ids, wts, **wide, config=cfg)
    assert torch.equal(y1, y2)
    check(y1, moe_experts_mxfp4_ref(x, ids, wts, **wide), bf16=dtype == torch.bfloat16)


def test_wide_fixture_sums_round(wide):
    """The tests below would see a change of summation order: with these scales and fp32
    activations the fp32 sums round, so "fma" (group sums) and "dot" (dot products) differ."""
    x, ids, wts = crowded_inputs(5, 3, seed=8)
    ys = [moe_experts_mxfp4(x, ids, wts, **wide, config=pick_config(5, 3, E2, D2, I2, mode=m)) for m in ("fma", "dot")]
    assert not torch.equal(*ys)


@pytest.mark.parametrize("mode", list(MOE.MODES))
def test_batch_invariance(mode, wide):
    """A row's result is the same bits alone (M = 1) and inside a batch (other rows share its
    experts, pick_config's slot groups differ with M)."""
    x, ids, wts = crowded_inputs(5, 3, seed=8)
    batch = moe_experts_mxfp4(x, ids, wts, **wide, config=pick_config(5, 3, E2, D2, I2, mode=mode))
    for m in (0, 3, 4):
        alone = moe_experts_mxfp4(x[m:m + 1], ids[m:m + 1], wts[m:m + 1], **wide,
                                  config=pick_config(1, 3, E2, D2, I2, mode=mode))
        assert torch.equal(alone[0], batch[m]), (mode, m)


@pytest.mark.parametrize("cfg", [MoeConfig(16, 32, 1, 128, 6, 8), MoeConfig(128, 128, 1, 128, 4, 1),
                                 MoeConfig(64, 16, 2, 128, 2, 1),
                                 MoeConfig(32, 64, 16, 128, 3, 2, mode="dot_asm"),
                                 MoeConfig(64, 128, 16, 128, 1, 1, num_warps=8, mode="dot_asm"),
                                 MoeConfig(32, 64, 16, 128, 3, 2, mode="dot_scaled")], ids=cfg_id)
def test_act_quant_in_gate_up_gives_the_bits_of_its_own_launch(cfg, monkeypatch):
    """The activation quantization done by gate-up's last program per (pair, 128-block) gives
    the bits of the separate launch: per-pair outputs and the sums, crowded experts (> 16 pairs
    of one expert, several chunks), I = 224 (a full 128-block and a ragged one), every I tile
    size; twice in a row (the counters reset themselves)."""
    ex = random_stacked_experts(E2, D2, 224, seed=23, dev=DEV, scales=(110, 130))
    tab = stacked_table(**ex)  # addresses of ex's tensors: ex stays alive below
    # "fma" takes 1-4 pairs per program: 5 rows still give expert 2 several chunks (7 pairs) at
    # less than half the interpreter's time; the dot modes' 16-pair chunks need 11 rows
    x, ids, wts = crowded_inputs(11 if cfg.block_p == 16 else 5, 3, seed=9)
    assert int((ids == 2).sum()) > cfg.block_p  # more than one chunk of one expert
    assert ids.numel() <= MOE.FUSED_ACT_QUANT_MAX_PAIRS  # the default takes the fused path here
    monkeypatch.setattr(MOE, "FUSED_ACT_QUANT_MAX_PAIRS", 0)
    apart = moe_experts_table(x, ids, wts, tab, config=cfg, return_pairs=True)
    monkeypatch.undo()
    for _ in range(2):
        assert torch.equal(moe_experts_table(x, ids, wts, tab, config=cfg, return_pairs=True), apart)
        # each (pair, block) counted exactly its I tiles: every counter is back at 0
        assert not workspace(x.device, "counters_moe_act", 1, torch.int32).any()
    assert torch.equal(moe_experts_table(x, ids, wts, tab, config=cfg), sum_pairs(apart))  # the summing launch too
    del ex


def scattered_experts(st, seed, offset=0):
    """Each expert's four tensors copied into its own allocation, allocated in random order
    between spacer allocations (so the addresses are in no particular order); offset bytes into
    each allocation lower the address alignment."""
    g = torch.Generator().manual_seed(seed)
    E_ = st["w13"].shape[0]
    names = ("w13", "w13_scale", "w2", "w2_scale")
    order = torch.randperm(E_ * 4, generator=g).tolist()
    out = [[None] * 4 for _ in range(E_)]
    keep = []
    for i in order:
        e, j = divmod(i, 4)
        src = st[names[j]][e]
        keep.append(torch.empty(int(torch.randint(1, 4000, (1,), generator=g)), dtype=torch.uint8, device=src.device))
        buf = torch.empty(src.numel() + offset, dtype=torch.uint8, device=src.device)
        t = buf[offset:].view(src.shape).view(src.dtype)
        t.copy_(src)
        out[e][j] = t
    return [tuple(ex) for ex in out]


@pytest.mark.parametrize("mode", list(MOE.MODES))
def test_table_from_separate_allocations(mode, wide):
    x, ids, wts = crowded_inputs(5, 3, seed=13)
    cfg = pick_config(5, 3, E2, D2, I2, mode=mode)
    want = moe_experts_mxfp4(x, ids, wts, **wide, config=cfg)
    for offset, align in ((0, 16), (4, 4)):
        tab = ExpertTable.from_experts(scattered_experts(wide, seed=offset, offset=offset))
        assert tab.E == E2 and (tab.D, tab.I) == (D2, I2) and tab.align == align and tab.device == x.device
        addr = tab.addr[:, 0].cpu()
        assert not torch.equal(addr, addr.sort().values)  # not in expert order
        assert torch.equal(moe_experts_table(x, ids, wts, tab, config=cfg), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["fma", "dot_asm"])
def test_shared_added_by_the_combine(mode, dtype, wide):
    """shared=s: the combine adds the shared expert's output to the slot-order sum and rounds once,
    exactly (routed + s.float()).to(s.dtype); a callable is called for s; not with return_pairs."""
    x, ids, wts = crowded_inputs(5, 3, seed=17, dtype=dtype)
    cfg = pick_config(5, 3, E2, D2, I2, mode=mode)
    tab = stacked_table(wide["w13"], wide["w13_scale"], wide["w2"], wide["w2_scale"])
    routed = moe_experts_table(x, ids, wts, tab, config=cfg)
    s = (torch.randn(5, D2, generator=torch.Generator().manual_seed(3)) * routed.abs().max().cpu()).to(dtype).to(DEV)
    want = (routed + s.float()).to(dtype)
    got = moe_experts_table(x, ids, wts, tab, config=cfg, shared=s)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.bfloat16:  # the rounding of the sum is the result's only one
        assert not torch.equal(want, (routed.to(dtype).float() + s.float()).to(dtype))
    calls = []
    assert torch.equal(moe_experts_table(x, ids, wts, tab, config=cfg, shared=lambda: calls.append(1) or s), want)
    assert calls == [1]
    with pytest.raises(ValueError, match="not with return_pairs"):
        moe_experts_table(x, ids, wts, tab, config=cfg, shared=s, return_pairs=True)


@pytest.mark.parametrize("mode", ["fma", "dot"])
def test_expert_parallel_shards_recombine_bit_exactly(mode, wide):
    """Expert parallelism: each "rank" holds a table with only its experts (the others absent,
    address 0), returns per-pair outputs (zero for absent experts), the ranks' buffers are added as
    integers (one non-zero addend per word, as runtime.distributed.ordered_combine does) and summed
    in slot order: the bits of the one-table kernel, whatever the split."""
    x, ids, wts = crowded_inputs(5, 3, seed=17)
    cfg = pick_config(5, 3, E2, D2, I2, mode=mode)
    want = moe_experts_mxfp4(x, ids, wts, **wide, config=cfg)
    full = ExpertTable.from_stacked(*(wide[n] for n in ("w13", "w13_scale", "w2", "w2_scale")))
    pairs_full = moe_experts_table(x, ids, wts, full, config=cfg, return_pairs=True)
    assert pairs_full.shape == (5, 3, D2) and pairs_full.dtype == x.dtype
    assert torch.equal(sum_pairs(pairs_full), want)
    experts = [tuple(wide[n][e] for n in ("w13", "w13_scale", "w2", "w2_scale")) for e in range(E2)]
    for owners in ([0, 0, 1, 1, 0, 1, 0, 1], [e % 3 for e in range(E2)]):
        total = torch.zeros_like(pairs_full).view(torch.int32)
        for r in sorted(set(owners)):
            tab = ExpertTable.from_experts([ex if owners[e] == r else None for e, ex in enumerate(experts)])
            assert tab.sparse
            y = moe_experts_table(x, ids, wts, tab, config=cfg, return_pairs=True)
            mine = torch.tensor([owners[e] == r for e in ids.flatten().tolist()], device=y.device).view(5, 3)
            assert (y[~mine] == 0).all() and torch.equal(y[mine], pairs_full[mine])
            total += y.view(torch.int32)
        assert torch.equal(sum_pairs(total.view(x.dtype)), want)
    with pytest.raises(ValueError, match="return_pairs"):
        moe_experts_table(x, ids, wts, tab, config=cfg)


def test_table_shapes_checks_and_cache(wide):
    tab = ExpertTable.from_stacked(**wide)
    st = wide["w13"]
    assert tab.addr.dtype == torch.int64 and tuple(tab.addr.shape) == (E2, 4)
    assert int(tab.addr[3, 0]) == st.data_ptr() + 3 * st.stride(0) and tab.strides[0] == D2 // 2
    tab.check_scales()
    ExpertTable.from_experts(scattered_experts(wide, seed=1)).check_scales()
    bad = dict(wide, w2_scale=wide["w2_scale"].clone())
    bad["w2_scale"].view(torch.uint8)[1, 2, 0] = 250
    with pytest.raises(ValueError, match="outside the supported"):
        ExpertTable.from_stacked(**bad).check_scales()
    # the wrapper's table is built once per tensors (a dict lookup afterwards), addresses only
    assert MOE.stacked_table(**wide) is MOE.stacked_table(**wide)
    assert MOE.stacked_table(**wide).tensors == ()
    ex = scattered_experts(wide, seed=2)
    ex[3] = (ex[3][0], ex[3][1], ex[3][2][:, :-2], ex[3][3])  # a wrong shape
    with pytest.raises(AssertionError):
        ExpertTable.from_experts(ex)


def test_repeated_expert_in_a_row_and_more_pairs_than_block(experts):
    x, ids, wts = make_inputs(6, D, E, 4, seed=9, distinct=False)
    ids[0] = torch.tensor([2, 2, 5, 2], dtype=torch.int32)
    cfg = MoeConfig(32, 64, 2, 256, 2, 2)  # expert 2 has > 2 pairs: several pair chunks
    check(moe_experts_mxfp4(x, ids, wts, **experts, config=cfg), moe_experts_mxfp4_ref(x, ids, wts, **experts))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(-g) -> inf, silu -> -0
def test_fp32_activations_and_limit(experts):
    x, ids, wts = make_inputs(3, D, E, K, seed=4, dtype=torch.float32)
    x = x * 8  # large pre-activations: the swiglu clamp is active
    for lim in (10.0, 0.5):
        check(moe_experts_mxfp4(x, ids, wts, **experts, swiglu_limit=lim),
              moe_experts_mxfp4_ref(x, ids, wts, **experts, swiglu_limit=lim), bf16=False)


def test_counters_reset_between_calls(experts):
    cfg = MoeConfig(32, 32, 1, 128, 2, 3)
    a = make_inputs(2, D, E, K, seed=1)
    b = make_inputs(4, D, E, K, seed=2)
    ra, rb = (moe_experts_mxfp4_ref(*t, **experts) for t in (a, b))
    for _ in range(2):
        check(moe_experts_mxfp4(*a, **experts, config=cfg), ra)
        check(moe_experts_mxfp4(*b, **experts, config=cfg), rb)


def test_stack_experts_layout():
    per, st = make_experts(3, 64, 32, seed=2, dev="cpu")
    p = "layers.7.ffn.experts."
    assert st["w13"].shape == (3, 64, 32) and st["w13_scale"].shape == (3, 64, 2)
    assert st["w2"].shape == (3, 64, 16) and st["w2_scale"].shape == (3, 64, 1)
    assert st["w13_scale"].dtype == torch.float8_e8m0fnu and st["w13"].dtype == torch.int8
    assert torch.equal(st["w13"][1, :32], per[p + "1.w1.weight"]) and torch.equal(st["w13"][1, 32:], per[p + "1.w3.weight"])
    assert torch.equal(st["w13_scale"][2, 32:].view(torch.uint8), per[p + "2.w3.scale"].view(torch.uint8))
    assert torch.equal(st["w2"][0], per[p + "0.w2.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 16, 64])
@pytest.mark.parametrize("mode", list(MOE.ALL_MODES))
def test_gpu_v4_shape_matches_ref_and_is_deterministic(M, mode):
    """V4-Flash expert shapes (D 4096, I 2048, k 6) with 32 experts (routing over 32 keeps the
    test's memory and ref time small while giving several pairs per expert); row 0 alone gives
    the same bits as inside the batch."""
    ex = random_stacked_experts(32, 4096, 2048, seed=5, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M, dev="cuda")
    cfg = pick_config(M, 6, 32, 4096, 2048, mode=mode)
    y1 = moe_experts_mxfp4(x, ids, wts, **ex, config=cfg)
    y2 = moe_experts_mxfp4(x, ids, wts, **ex, config=cfg)
    alone = moe_experts_mxfp4(x[:1], ids[:1], wts[:1], **ex, config=pick_config(1, 6, 32, 4096, 2048, mode=mode))
    torch.cuda.synchronize()
    assert torch.equal(y1, y2)
    assert torch.equal(alone[0], y1[0])
    check(y1, moe_experts_mxfp4_ref(x, ids, wts, **ex))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gpu_act_quant_in_gate_up_gives_the_bits_of_its_own_launch(M, monkeypatch):
    """V4-Flash expert shapes on the device (programs really concurrent): the quantization by
    gate-up's last program per (pair, block) gives the separate launch's bits; 3 calls in a row."""
    ex = random_stacked_experts(32, 4096, 2048, seed=7, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M + 3, dev="cuda")
    cfg = pick_config(M, 6, 32, 4096, 2048)
    assert ids.numel() <= MOE.FUSED_ACT_QUANT_MAX_PAIRS
    monkeypatch.setattr(MOE, "FUSED_ACT_QUANT_MAX_PAIRS", 0)
    apart = moe_experts_mxfp4(x, ids, wts, **ex, config=cfg)
    monkeypatch.undo()
    for _ in range(3):
        assert torch.equal(moe_experts_mxfp4(x, ids, wts, **ex, config=cfg), apart)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_asm_decode_gives_the_bits_of_the_triton_decode(M):
    """"dot_asm" changes only how the weight bytes become bf16 (inline PTX instead of Triton
    ops): the decoded values, the dots and so every output bit equal those of "dot"."""
    ex = random_stacked_experts(32, 4096, 2048, seed=6, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M + 1, dev="cuda")
    y = {mode: moe_experts_mxfp4(x, ids, wts, **ex, config=pick_config(M, 6, 32, 4096, 2048, mode=mode))
         for mode in ("dot", "dot_asm")}
    assert torch.equal(y["dot"], y["dot_asm"])


# ---- mode "lut": the CUDA C++ kernels (kernels/moe_lut.py) ----------------------------------------
def test_lut_mode_off_cuda_is_a_clear_error(experts):
    x, ids, wts = make_inputs(2, D, E, K, seed=3)
    with pytest.raises(ValueError, match="'lut' needs a CUDA device"):
        moe_experts_mxfp4(x, ids, wts, **experts, config=pick_config(2, K, E, D, I, mode="lut"))
    assert not MOE.permutes("lut") and "lut" in MOE.ALL_MODES and "lut" not in MOE.MODES


def _parts(ex):
    return [tuple(ex[n][e] for n in ("w13", "w13_scale", "w2", "w2_scale")) for e in range(ex["w13"].shape[0])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 5, 64])
def test_gpu_lut_expert_parallel_and_host_memory_tables(M):
    """V4-Flash expert shapes, mode "lut": per-pair outputs of sparse tables (expert parallelism)
    recombine to the one-table bits, absent experts' pairs stay untouched (zero); experts read
    from page-locked host memory through the table give the bits of experts in HBM."""
    ex = random_stacked_experts(32, 4096, 2048, seed=8, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M + 9, dev="cuda")
    cfg = pick_config(M, 6, 32, 4096, 2048, mode="lut")
    want = moe_experts_mxfp4(x, ids, wts, **ex, config=cfg)
    full = ExpertTable.from_stacked(*(ex[n] for n in ("w13", "w13_scale", "w2", "w2_scale")))
    pairs_full = moe_experts_table(x, ids, wts, full, config=cfg, return_pairs=True)
    assert torch.equal(sum_pairs(pairs_full), want)
    owners = [e % 3 for e in range(32)]
    total = torch.zeros_like(pairs_full).view(torch.int16)
    for r in range(3):
        held = [p if owners[e] == r else None for e, p in enumerate(_parts(ex))]
        y = moe_experts_table(x, ids, wts, ExpertTable.from_experts(held, device="cuda"), config=cfg, return_pairs=True)
        mine = torch.tensor([owners[e] == r for e in ids.flatten().tolist()], device="cuda").view(M, 6)
        assert (y[~mine] == 0).all() and torch.equal(y[mine], pairs_full[mine])
        total += y.view(torch.int16)
    assert torch.equal(sum_pairs(total.view(x.dtype)), want)
    cold = [tuple(t.cpu().pin_memory() for t in p) if e % 2 else p for e, p in enumerate(_parts(ex))]
    host = ExpertTable.from_experts(cold, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(moe_experts_table(x, ids, wts, host, config=cfg), want)
    # the shared expert's output added by the combine: one rounding of the sum
    s = (torch.randn(M, 4096, generator=torch.Generator().manual_seed(M), device="cpu") * want.abs().max().cpu()
         ).bfloat16().cuda()
    got = moe_experts_table(x, ids, wts, full, config=cfg, shared=s)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (want + s.float()).bfloat16())


def _lut_outputs(ex, x, ids, wts):
    """What a "lut" kernel variant must give bit for bit, at V4-Flash expert shapes (32 experts):
    a function returning the per-pair outputs, the combine, the combine with a shared expert's
    output, and a sparse table's pairs (every other expert: expert parallelism)."""
    M = x.shape[0]
    cfg = pick_config(M, 6, 32, 4096, 2048, mode="lut")
    full = ExpertTable.from_stacked(*(ex[n] for n in ("w13", "w13_scale", "w2", "w2_scale")))
    half = ExpertTable.from_experts([p if e % 2 else None for e, p in enumerate(_parts(ex))], device="cuda")
    s = (torch.randn(M, 4096, generator=torch.Generator().manual_seed(M)) * 4).bfloat16().cuda()

    def outputs():
        return (moe_experts_table(x, ids, wts, full, config=cfg, return_pairs=True),
                moe_experts_table(x, ids, wts, full, config=cfg),
                moe_experts_table(x, ids, wts, full, config=cfg, shared=s),
                moe_experts_table(x, ids, wts, half, config=cfg, return_pairs=True))

    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("ring", [False, True])
def test_gpu_lut_spread_gate_up_gives_the_same_bits(M, ring, monkeypatch):
    """The spread gate-up (M in moe_lut.SPREAD_ROWS: warp tasks dealt out evenly over one CTA per
    SM), with its weights in registers or in the ring's slots (SPREAD_RING), gives the bits of the
    whole-item kernel: per-pair outputs, the combine, the combine with the shared expert's output,
    a sparse table's pairs (expert parallelism), at V4-Flash expert shapes; three calls. At M = 2
    a slot holds both rows' pairs (two x rows staged)."""
    from megastep.kernels import moe_lut

    _pair_major(monkeypatch)
    monkeypatch.setattr(moe_lut, "SPREAD_RING", ring)
    monkeypatch.setattr(moe_lut, "RING_MIN_ROWS", None)  # (the whole items in registers)
    if ring:  # (on a Hopper the spread ring is taken: the arms differ)
        assert moe_lut._ring_fits(0, moe_lut.shared_bytes(4096, 1, moe_lut.SPREAD_WARPS)) or \
            torch.cuda.get_device_capability()[0] < 9

    ex = random_stacked_experts(32, 4096, 2048, seed=11, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M + 13, dev="cuda")
    if M == 2:
        ids[1, 0] = ids[0, 2]  # a slot with two pairs, one from each row
        assert len(set(ids[1].tolist())) == 6
    outputs = _lut_outputs(ex, x, ids, wts)

    monkeypatch.setattr(moe_lut, "SPREAD_ROWS", (M,))
    assert moe_lut.spread_rows(torch.zeros(M * 6), 6) == M
    got = [outputs() for _ in range(3)]
    monkeypatch.setattr(moe_lut, "SPREAD_ROWS", ())
    assert moe_lut.spread_rows(torch.zeros(M * 6), 6) == 0
    want = outputs()
    check(want[1], moe_experts_mxfp4_ref(x, ids, wts, **ex))
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want))


def _many_pair_inputs(M, seed):
    """32 experts at V4-Flash shapes and M rows of top-6 routing; from 3 rows on expert 0 is in
    every row (a slot of M pairs: several passes over its rows)."""
    ex = random_stacked_experts(32, 4096, 2048, seed=seed, dev="cuda")
    x, ids, wts = make_inputs(M, 4096, 32, 6, seed=M + seed + 2, dev="cuda")
    if M >= 3:
        ids[:, 0] = torch.where((ids == 0).any(1), ids[:, 0], 0)
        assert (ids == 0).any(1).all()
    return ex, x, ids, wts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_gpu_lut_slots_of_many_pairs(M, monkeypatch):
    """The pair-major MMA columns (gate-up without moe_lut.GATE_UP_GM, and down) over slots of one, two
    and several pairs (several passes over an expert's rows, each pass's x rows staged anew) at V4-Flash
    expert shapes: the combine matches the reference, and a second call gives the same bits in all four
    outputs (per-pair, the combine, the combine with the shared expert's output, a sparse table's pairs)."""
    _pair_major(monkeypatch)
    ex, x, ids, wts = _many_pair_inputs(M, 17)
    outputs = _lut_outputs(ex, x, ids, wts)

    want = outputs()
    check(want[1], moe_experts_mxfp4_ref(x, ids, wts, **ex))
    got = outputs()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _pair_major(monkeypatch):
    """The pair-major kernels for gate-up and down (moe_lut.GATE_UP_GM and DOWN_GM off): the tests of their forms."""
    from megastep.kernels import moe_lut

    monkeypatch.setattr(moe_lut, "GATE_UP_GM", False)
    monkeypatch.setattr(moe_lut, "DOWN_GM", False)


def _same_bits_when(monkeypatch, setting, off, on, smem, ex, x, ids, wts):
    """The lut outputs (_lut_outputs) with moe_lut.<setting> = on equal, in three calls and bit for
    bit, those with it = off, which are checked against the ref first. smem: the shared memory the
    on-arm's kernel takes, which a Hopper gives (else it would not be taken: the arms must differ)."""
    from megastep.kernels import moe_lut

    outputs = _lut_outputs(ex, x, ids, wts)
    monkeypatch.setattr(moe_lut, setting, off)
    want = outputs()
    check(want[1], moe_experts_mxfp4_ref(x, ids, wts, **ex))
    monkeypatch.setattr(moe_lut, setting, on)
    assert moe_lut._ring_fits(x.device.index, smem) or torch.cuda.get_device_capability(x.device)[0] < 9
    for _ in range(3):
        got = outputs()
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_gpu_lut_ring_gives_the_same_bits(M, monkeypatch):
    """The ring gate-up (moe_lut.ring_rows: the weights' steps in flight in shared memory, two items
    per CTA in halves that share the table) gives the register ring's bits at V4-Flash expert
    shapes: per-pair outputs, the combine, the combine with the shared expert's output, a sparse
    table's pairs; slots of one, two and several pairs (several passes); three calls."""
    from megastep.kernels import moe_lut

    _pair_major(monkeypatch)
    _same_bits_when(monkeypatch, "RING_MIN_ROWS", None, 1, moe_lut.shared_bytes(4096, 2, 16), *_many_pair_inputs(M, 23))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_lut_one_row_ring_on_fewer_sms_gives_the_same_bits(monkeypatch):
    """The 1-row ring gate-up on fewer CTAs than SMs (moe_lut.RING_ONE_ROW_SMS; 96: every CTA takes two
    items) gives the bits of a CTA per SM: per-pair outputs, the combine, the combine with the shared
    expert's output, a sparse table's pairs; three calls."""
    from megastep.kernels import moe_lut

    assert moe_lut.ring_rows(1) and moe_lut._sms(0) > 96
    _pair_major(monkeypatch)
    _same_bits_when(monkeypatch, "RING_ONE_ROW_SMS", None, 96, moe_lut.shared_bytes(4096, 2, 16, mix=moe_lut.RING_MIX),
                    *_many_pair_inputs(1, 29))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 3, 4, 5, 16, 64])
def test_gpu_lut_down_in_passes_of_four_pairs_gives_the_same_bits(M, monkeypatch):
    """down in passes of 4 pairs (moe_lut.DOWN4_MIN_ROWS: moe_down_lut4, each decoded weight fragment fed
    to the MMAs of two pair sets) gives the 2-pair passes' bits at V4-Flash expert shapes: per-pair
    outputs, the combine, the combine with the shared expert's output, a sparse table's pairs; slots of
    1-4 pairs (one pass) and of M pairs (expert 0 in every row: passes of 4, the last one partial, at 5,
    16 and 64 rows); three calls."""
    from megastep.kernels import moe_lut

    _pair_major(monkeypatch)
    _same_bits_when(monkeypatch, "DOWN4_MIN_ROWS", None, 1, moe_lut.shared_bytes(2048, four=True),
                    *_many_pair_inputs(M, 41))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 8, 16, 64])
def test_gpu_lut_ring_mix_gives_the_same_bits(M, monkeypatch):
    """The ring gate-up's mixed decode (moe_lut.RING_MIX: the groups of x's odd 128-blocks on fp16 MMAs
    with operands built by prmt, those blocks of x staged as their e4m3 codes in fp16 with their
    scales joining the groups'; the even blocks by the table) gives the table's bits at V4-Flash
    expert shapes: per-pair outputs, the combine, the combine with the shared expert's output, a
    sparse table's pairs; slots of one, two and several pairs; at the row counts the ring takes; three
    calls."""
    from megastep.kernels import moe_lut

    assert moe_lut.ring_rows(M)
    _pair_major(monkeypatch)
    _same_bits_when(monkeypatch, "RING_MIX", False, True, moe_lut.shared_bytes(4096, 2, 16, mix=True),
                    *_many_pair_inputs(M, 37))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 2])
def test_gpu_lut_spread_ring_mix_gives_the_same_bits(M, monkeypatch):
    """The spread gate-up with the ring's slots and the mixed decode (moe_lut.SPREAD_RING_MIX) gives the
    table's bits at V4-Flash expert shapes: per-pair outputs, the combine (with and without the
    shared expert's output), a sparse table's pairs; at 2 rows a slot holding both rows' pairs;
    three calls."""
    from megastep.kernels import moe_lut

    _pair_major(monkeypatch)
    monkeypatch.setattr(moe_lut, "SPREAD_ROWS", (1, 2))
    monkeypatch.setattr(moe_lut, "SPREAD_RING", True)
    ex, x, ids, wts = _many_pair_inputs(M, 41)
    if M == 2:  # a slot with both rows' pairs
        ids[1, 0] = next(e for e in ids[0].tolist() if e not in ids[1].tolist())
    _same_bits_when(monkeypatch, "SPREAD_RING_MIX", False, True,
                    moe_lut.shared_bytes(4096, 1, moe_lut.SPREAD_WARPS, mix=True), ex, x, ids, wts)


def _group_major_checks(M, seed):
    """The checks of a group-major kernel (the settings already made) on _many_pair_inputs(M, seed): the combine
    against the reference; three calls bit-identical in the four lut outputs; rows 0, M / 2 and M - 1 alone give
    their per-pair bits in the batch; experts in page-locked host memory give the combine of HBM. Returns the
    outputs function and the first call's outputs."""
    ex, x, ids, wts = _many_pair_inputs(M, seed)
    outputs = _lut_outputs(ex, x, ids, wts)
    want = outputs()
    check(want[1], moe_experts_mxfp4_ref(x, ids, wts, **ex))
    for _ in range(2):
        got = outputs()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    full = ExpertTable.from_stacked(*(ex[n] for n in ("w13", "w13_scale", "w2", "w2_scale")))
    for m in sorted({0, M // 2, M - 1}):
        alone = moe_experts_table(x[m:m + 1], ids[m:m + 1], wts[m:m + 1], full,
                                  config=pick_config(1, 6, 32, 4096, 2048, mode="lut"), return_pairs=True)
        assert torch.equal(alone[0], want[0][m]), m
    cold = [tuple(t.cpu().pin_memory() for t in p) if e % 2 else p for e, p in enumerate(_parts(ex))]
    host = ExpertTable.from_experts(cold, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(moe_experts_table(x, ids, wts, host, config=pick_config(M, 6, 32, 4096, 2048, mode="lut")),
                       want[1])
    return outputs, want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 2, 3, 9, 16, 64])
def test_gpu_lut_group_major_gate_up(M, monkeypatch):
    """The group-major gate-up (moe_lut.GATE_UP_GM, every gate-up launch: passes of 8 pairs) at V4-Flash
    expert shapes: the combine matches the reference; three calls give the same bits in all four
    outputs (per-pair, the combine, the combine with the shared expert's output, a sparse table's
    pairs); every row alone gives its per-pair bits in the batch (a pass's other columns never meet
    its own: batch invariance); experts read from page-locked host memory give the bits of HBM; up to 8
    rows every schedule (items, the even deal of warp tasks, and up to 2 rows the task halves on warp
    pairs) gives the same bits. From 3 rows on expert 0 is in every row: a slot of M pairs, passes of 8,
    the last one partial at 9, 16 and 64 rows."""
    from megastep.kernels import moe_lut

    monkeypatch.setattr(moe_lut, "GATE_UP_GM", True)
    assert moe_lut._ring_fits(0, moe_lut.gm_shared_bytes(4096)) or torch.cuda.get_device_capability()[0] < 9
    assert moe_lut._ring_fits(0, moe_lut.gm_few_shared_bytes(4096)) or torch.cuda.get_device_capability()[0] < 9
    outputs, want = _group_major_checks(M, 43)
    # every other schedule of M rows (items, the even deal of warp tasks, the task halves on warp pairs) gives
    # the same bits
    if M <= moe_lut.GM_PAIRS:
        for few, spread in (((), ()), ((), (M,)), ((M,), ())):
            if few and M > moe_lut.GM_FEW_ROWS_MAX:
                continue
            monkeypatch.setattr(moe_lut, "GM_FEW_ROWS", few)
            monkeypatch.setattr(moe_lut, "GM_SPREAD_ROWS", spread)
            got = outputs()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (few, spread)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 2, 3, 9, 16, 64])
def test_gpu_lut_group_major_down(M, monkeypatch):
    """The group-major down (moe_lut.DOWN_GM, every down launch: passes of 8 pairs, items of 256 rows, the
    combine per 256-row tile) at V4-Flash expert shapes: the combine matches the reference; three calls give
    the same bits in all four outputs (per-pair, the combine, the combine with the shared expert's output, a
    sparse table's pairs); every row alone gives its per-pair bits in the batch (batch invariance); experts
    read from page-locked host memory give the bits of HBM; the kernel that reads its first item's routing before
    the PDL wait (DOWN_GM_EARLY), or the one that does not, gives the same bits. From 3 rows on expert 0 is in every
    row: a slot of M pairs, passes of 8, the last one partial at 9, 16 and 64 rows."""
    from megastep.kernels import moe_lut

    monkeypatch.setattr(moe_lut, "DOWN_GM", True)
    smem = moe_lut.gm_shared_bytes(2048, moe_lut.GM_DOWN_DEPTH)
    assert moe_lut._ring_fits(0, smem) or torch.cuda.get_device_capability()[0] < 9
    outputs, want = _group_major_checks(M, 47)
    # the kernel with the first item's routing read before the PDL wait (moe_lut.DOWN_GM_EARLY) gives the same bits
    monkeypatch.setattr(moe_lut, "DOWN_GM_EARLY", not moe_lut.DOWN_GM_EARLY)
    got = outputs()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte k = byte (selector nibble k & 7) of {b, a}, or that
    byte's top bit replicated where the nibble's bit 3 is set."""
    src = a | (b << 32)
    out = 0
    for k in range(4):
        n = (sel >> (4 * k)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if n & 8 else byte) << (8 * k)
    return out


def test_f16_decode_gives_exact_values():
    """decode_f16 in moe_lut.cu, emulated from its own constants and selectors (read from the source,
    in order): every 32-bit word of 8 e2m1 codes gives, for each byte, the fp16x2 of its two codes'
    values (low nibble in the low half), exactly; and e2m1 in fp16 has a zero low byte, which the
    decode relies on. All 256 bytes in every byte position."""
    from megastep.kernels import moe_lut

    src = open(moe_lut.SOURCE).read()
    body = src[src.index("void decode_f16("):]
    body = body[:body.index("\n}\n")]
    t0, t1 = (int(v, 16) for v in re.search(r"kT0 = (0x[0-9A-F]+)u, kT1 = (0x[0-9A-F]+)u", body).groups())
    sels = [int(v, 16) for v in re.findall(r"prmt\([^;]*?, (0x[0-9A-F]+)u\)", body)]
    assert len(sels) == 6, sels  # two sign spreads, four expansions
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def value(code):
        return (-1.0 if code & 8 else 1.0) * e2m1[code & 7]

    def fp16(bits):  # the value of fp16 bits
        return torch.tensor([bits], dtype=torch.uint16).view(torch.float16).item()

    def fp16_bits(v):
        return torch.tensor([v], dtype=torch.float16).view(torch.uint16).item()

    for code in range(16):
        assert fp16(fp16_bits(value(code))) == value(code)
        assert fp16_bits(value(code)) & 0xFF == 0
    mask = 0xFFFFFFFF
    for b in range(256):
        for pos in range(4):
            w = (b << (8 * pos)) | (0x5A << (8 * ((pos + 1) % 4)))  # (a neighbour byte, that must not leak in)
            m, ws = w & 0x77777777, (w << 4) & mask
            lo = _prmt(t0, t1, m) | (_prmt(w, ws, sels[0]) & 0x80808080)
            hi = _prmt(t0, t1, m >> 16) | (_prmt(w, ws, sels[1]) & 0x80808080)
            d = [_prmt(lo, 0, sels[2]), _prmt(lo, 0, sels[3]), _prmt(hi, 0, sels[4]), _prmt(hi, 0, sels[5])]
            got = (fp16(d[pos] & 0xFFFF), fp16(d[pos] >> 16))
            assert got == (value(b & 15), value(b >> 4)), (b, pos, got)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_lut_kernels_build_for_sm90():
    """The "lut" kernels compile (nvcc, sm_90) with the header they include, with no local memory:
    a spill would put loads in the experts' inner loop."""
    from megastep.kernels import moe_lut

    kernels = ("moe_gate_up_lut", "moe_down_lut", "moe_gate_up_lut_spread", "moe_gate_up_lut_ring",
               "moe_gate_up_lut_spread_ring", "moe_gate_up_lut_ring_mix", "moe_gate_up_lut_spread_ring_mix",
               "moe_down_lut4", "moe_gate_up_gm", "moe_gate_up_gm_spread", "moe_gate_up_gm_few", "moe_down_gm",
               "moe_down_gm_early")
    assert_builds_without_spills(moe_lut.SOURCE, kernels)
    # the probe builds (benchmarks/kernels/moe_lut_probe.py): the same kernels with their stamps, and
    # without their loads (all but moe_down_lut4 and the group-major ones, which they leave out)
    probed = tuple(k for k in kernels if k != "moe_down_lut4" and "_gm" not in k) + ("moe_lut_probe_read",)
    for flags in (("-DMOE_LUT_PROBE",), ("-DMOE_LUT_PROBE", "-DMOE_LUT_NO_LOAD")):
        assert_builds_without_spills(moe_lut.SOURCE, probed, flags=flags)


def _launch_down(moe_lut, launched, M, I=2048, D=4096, topk=6):
    """moe_lut.down over M rows of zeros (a table of 256 experts, the combine on), and its launch's record."""
    pairs = torch.zeros(M * topk, dtype=torch.int32)
    addr = torch.zeros(256, 4, dtype=torch.int64)
    y = torch.zeros(M * topk, D, dtype=torch.bfloat16)
    moe_lut.down(torch.zeros(M * topk, I, dtype=torch.bfloat16), addr, pairs, pairs, pairs, pairs, pairs, y,
                 torch.zeros(M, D), pairs, D, I, (1, 1), topk, False, True)
    return launched.pop()


def _launch_gate_up(moe_lut, launched, M):
    """One moe_lut.gate_up launch of M rows at V4-Flash expert shapes (D 4096, I 2048, top-6) on CPU tensors, its
    kernels spied (_spy_lut_launches): the launch's record."""
    D, I, topk = 4096, 2048, 6
    pairs = torch.zeros(M * topk, dtype=torch.int32)
    addr = torch.zeros(256, 4, dtype=torch.int64)
    moe_lut.gate_up(torch.zeros(M, D, dtype=torch.bfloat16), addr, torch.zeros(M * topk), pairs, pairs, pairs, pairs,
                    pairs, torch.zeros(M * topk, I, dtype=torch.bfloat16), D, I, (1, 1), 10.0, topk, True, False)
    return launched.pop()


def _spy_lut_launches(monkeypatch, names):
    """moe_lut's kernels `names` replaced by spies that record each launch as (name, grid x, block x, shared
    memory, argument count); 132 SMs; a CTA gets fits["smem"] bytes of shared memory (a Hopper's 227 KB).
    Returns (the records, fits)."""
    from megastep.kernels import moe_lut

    launched, fits = [], {"smem": 227 << 10}

    class Spy:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, smem, stream, *args, pdl=False):
            launched.append((self.name, grid[0], block[0], smem, len(args)))

    for name in names:
        monkeypatch.setattr(moe_lut, name, Spy(name))
    monkeypatch.setattr(moe_lut, "_sms", lambda index: 132)
    monkeypatch.setattr(moe_lut, "_ring_fits", lambda index, nbytes: nbytes <= fits["smem"])
    return launched, fits


def test_lut_down_in_passes_of_four_pairs_is_taken_by_rows(monkeypatch):
    """Without moe_lut.DOWN_GM, moe_lut.down takes moe_down_lut4 from DOWN4_MIN_ROWS rows on (never while it is
    None), with the shared memory of 4 rows of x and the K half 0 sums after the table."""
    from megastep.kernels import moe_lut

    launched, _ = _spy_lut_launches(monkeypatch, ("_DOWN", "_DOWN4"))
    monkeypatch.setattr(moe_lut, "DOWN_GM", False)
    I = 2048

    def call(M):
        return _launch_down(moe_lut, launched, M)

    assert moe_lut.DOWN4_MIN_ROWS == 8  # measured to gain at 8-64 rows on one H100, to lose at 1-2
    assert [call(m)[0] for m in (1, 4, 7, 8, 16, 64)] == ["_DOWN", "_DOWN", "_DOWN", "_DOWN4", "_DOWN4", "_DOWN4"]
    monkeypatch.setattr(moe_lut, "DOWN4_MIN_ROWS", None)
    assert [call(m)[0] for m in (1, 16, 64)] == ["_DOWN"] * 3
    monkeypatch.setattr(moe_lut, "DOWN4_MIN_ROWS", 32)
    got = [call(m) for m in (1, 31, 32, 64)]
    assert [g[0] for g in got] == ["_DOWN", "_DOWN", "_DOWN4", "_DOWN4"]
    assert got[0][3] == moe_lut.LUT_BYTES + 4 * I and got[2][3] == moe_lut.LUT_BYTES + 8 * I + 8192
    assert len({g[4] for g in got}) == 1  # the same arguments either way
    # the pass width the bench counts down's passes at (bench.routed_reads) follows the same rule
    assert [moe_lut.down_pairs_per_pass(m) for m in (1, 31, 32, 64)] == [2, 2, 4, 4]


def test_lut_group_major_down_is_taken_for_every_launch(monkeypatch):
    """moe_lut.DOWN_GM (on: measured to gain at every row count): every down launch, whatever its rows, takes
    moe_down_gm_early (DOWN_GM_EARLY, on; a row's bits must not depend on its batch), items of (slot, GM_WARPS x
    16 rows) on one CTA of GM_WARPS warps per SM at most, with the shared memory of GM_DOWN_DEPTH (4) ring slots a
    warp (224.5 KB at I = 2048, within a Hopper's 227 KB) and down's arguments (DOWN_GM_EARLY off: moe_down_gm,
    launched alike); off, none does; a device that cannot give the shared memory (even if it could give 3 slots') keeps
    moe_down_lut / moe_down_lut4; the bench counts its passes at GM_PAIRS pairs."""
    from megastep.kernels import moe_lut

    launched, fits = _spy_lut_launches(monkeypatch, ("_DOWN", "_DOWN4", "_DOWN_GM", "_DOWN_GM_EARLY"))
    I = 2048

    def call(M):
        return _launch_down(moe_lut, launched, M)

    assert moe_lut.DOWN_GM and moe_lut.DOWN_GM_EARLY
    got = {m: call(m) for m in (1, 2, 8, 16, 64)}
    assert {g[0] for g in got.values()} == {"_DOWN_GM_EARLY"}
    smem = moe_lut.gm_shared_bytes(I, moe_lut.GM_DOWN_DEPTH)
    assert moe_lut.GM_DOWN_DEPTH == 4 and smem == 65536 + 8 * (2 * I + 64) + 16 * 4 * 2048 == 229888 <= 227 << 10
    assert {(g[2], g[3]) for g in got.values()} == {(512, smem)}
    assert got[1][1] == 6 * 16 and got[64][1] == 132  # items (slot, 256 rows): 1 row 96 CTAs; at most one per SM
    assert [moe_lut.down_pairs_per_pass(m) for m in (1, 64)] == [8, 8]
    fits["smem"] = 200 << 10  # (no room: the pair-major kernels, and the bench counts their passes)
    assert [call(m)[0] for m in (1, 64)] == ["_DOWN", "_DOWN4"]
    assert [moe_lut.down_pairs_per_pass(m, torch.device("cuda", 0), I) for m in (1, 64)] == [2, 4]
    fits["smem"] = 227 << 10
    # DOWN_GM_EARLY off: moe_down_gm for every launch instead, the same grid, block, shared memory and arguments
    monkeypatch.setattr(moe_lut, "DOWN_GM_EARLY", False)
    late = {m: call(m) for m in (1, 2, 8, 16, 64)}
    assert {g[0] for g in late.values()} == {"_DOWN_GM"}
    assert all(late[m][1:] == got[m][1:] for m in late)
    monkeypatch.setattr(moe_lut, "DOWN_GM", False)  # off: none, with the same arguments
    assert [call(m)[0] for m in (1, 8, 64)] == ["_DOWN", "_DOWN4", "_DOWN4"]
    assert call(64)[4] == got[64][4]
    assert [moe_lut.down_pairs_per_pass(m) for m in (1, 64)] == [2, 4]


def test_lut_ring_gate_up_is_taken_by_rows(monkeypatch):
    """moe_lut.ring_rows: the ring gate-up at 1 row and from RING_MIN_ROWS rows on (measured to gain
    at 1 and 8-64 rows, to lose at 4), never with RING_MIN_ROWS None."""
    from megastep.kernels import moe_lut

    assert [moe_lut.ring_rows(m) for m in (1, 2, 4, 7, 8, 16, 64)] == [True, False, False, False, True, True, True]
    monkeypatch.setattr(moe_lut, "RING_MIN_ROWS", 16)
    assert [moe_lut.ring_rows(m) for m in (1, 8, 15, 16)] == [True, False, False, True]
    monkeypatch.setattr(moe_lut, "RING_MIN_ROWS", None)
    assert not any(moe_lut.ring_rows(m) for m in (1, 2, 16, 64))


def test_lut_group_major_gate_up_is_taken_for_every_launch(monkeypatch):
    """moe_lut.GATE_UP_GM (on: measured to gain at 4-64 rows, within 0.25 % at 1-2): every gate-up launch,
    whatever its rows, takes a group-major kernel (a row's bits must not depend on its batch): at GM_FEW_ROWS
    (1; it can take 1-2) rows moe_gate_up_gm_few (one CTA of GM_FEW_WARPS warps per SM, a CTA for every
    GM_FEW_WARPS / 2 tasks, gm_few_shared_bytes), else one CTA of GM_WARPS warps per SM at most, the even deal
    of warp tasks at GM_SPREAD_ROWS (2-8) rows, else an item per (slot, GM_WARPS x 8 channels), with
    gm_shared_bytes (each within a Hopper's 227 KB at D = 4096, gm_few's the smaller); off, none does; a device
    that cannot give gm_shared_bytes keeps the other kernels."""
    from megastep.kernels import moe_lut

    launched, fits = _spy_lut_launches(monkeypatch, ("_GATE_UP", "_GATE_UP_SPREAD", "_GATE_UP_RING",
                                                     "_GATE_UP_SPREAD_RING", "_GATE_UP_RING_MIX",
                                                     "_GATE_UP_SPREAD_RING_MIX", "_GATE_UP_GM", "_GATE_UP_GM_SPREAD",
                                                     "_GATE_UP_GM_FEW"))
    D = 4096

    def call(M):
        return _launch_gate_up(moe_lut, launched, M)

    assert moe_lut.GATE_UP_GM and moe_lut.GM_SPREAD_ROWS == (2, 3, 4, 5, 6, 7, 8) and moe_lut.GM_FEW_ROWS == (1,)
    monkeypatch.setattr(moe_lut, "GM_FEW_ROWS", (1, 2))  # (both row counts it can take)
    got = {m: call(m) for m in (1, 2, 3, 8, 9, 64)}
    # 1-2 rows the warp pairs, 3-8 the even deal of warp tasks (both: their `rows` argument more), from 9 on items
    assert [got[m][0] for m in (1, 2, 3, 8, 9, 64)] == (["_GATE_UP_GM_FEW"] * 2 + ["_GATE_UP_GM_SPREAD"] * 2
                                                         + ["_GATE_UP_GM"] * 2)
    few = moe_lut.gm_few_shared_bytes(D)
    assert few == 65536 + 2 * (2 * D + 64) + 24 * 3 * 2048 < moe_lut.gm_shared_bytes(D)
    assert moe_lut.gm_shared_bytes(D) == 65536 + 8 * (2 * D + 64) + 16 * 3 * 2048 <= 227 << 10
    assert {(got[m][2], got[m][3]) for m in (1, 2)} == {(768, few)}
    assert {(got[m][2], got[m][3]) for m in (3, 8, 9, 64)} == {(512, moe_lut.gm_shared_bytes(D))}
    assert got[1][1] == 6 * 2048 // 8 // 12  # 1536 tasks, 12 a CTA: 128 CTAs
    assert [got[m][1] for m in (2, 3, 8, 9, 64)] == [132] * 5  # a CTA per SM
    # the ring kernels' arguments (the even deal's: and rows; the warp pairs': and rows and slots)
    assert got[9][4] == got[3][4] - 1 == got[2][4] - 2
    assert moe_lut.gate_up_pairs_per_pass() == 8
    monkeypatch.setattr(moe_lut, "GM_SPREAD_ROWS", (9,))  # (more rows than the .cu stages: refused)
    with pytest.raises(AssertionError):
        call(9)
    monkeypatch.setattr(moe_lut, "GM_FEW_ROWS", (3,))
    with pytest.raises(AssertionError):
        call(3)
    monkeypatch.setattr(moe_lut, "GM_FEW_ROWS", (1, 2))
    monkeypatch.setattr(moe_lut, "GM_SPREAD_ROWS", (2, 3, 4, 5, 6, 7, 8))
    fits["smem"] = 200 << 10  # (no room: the pair-major kernels, and the bench counts their passes)
    assert call(1)[0] not in ("_GATE_UP_GM", "_GATE_UP_GM_FEW")
    assert moe_lut.gate_up_pairs_per_pass(torch.device("cuda", 0), D) == 2
    assert moe_lut.gate_up_pairs_per_pass(torch.device("cpu"), D) == moe_lut.gate_up_pairs_per_pass() == 8
    fits["smem"] = 227 << 10
    monkeypatch.setattr(moe_lut, "GATE_UP_GM", False)  # off: none
    assert all(call(m)[0] not in ("_GATE_UP_GM", "_GATE_UP_GM_SPREAD", "_GATE_UP_GM_FEW") for m in (1, 2, 4, 16, 64))
    assert moe_lut.gate_up_pairs_per_pass() == 2


def test_lut_one_row_ring_leaves_sms_to_the_side_stream(monkeypatch):
    """moe_lut._ring_grid: one CTA per SM at most, each taking two items; at 1 row at most
    RING_ONE_ROW_SMS CTAs (V4-Flash's 192 items: 112 of 132 SMs), but never fewer than one per two
    items; other row counts and RING_ONE_ROW_SMS None keep a CTA per SM."""
    from megastep.kernels import moe_lut

    monkeypatch.setattr(moe_lut, "_sms", lambda index: 132)
    dev = torch.device("cpu")
    monkeypatch.setattr(moe_lut, "RING_ONE_ROW_SMS", 112)
    assert [moe_lut._ring_grid(n, dev, 1)[0] for n in (192, 100, 230, 300, 1)] == [112, 100, 115, 132, 1]
    assert [moe_lut._ring_grid(n, dev, 8)[0] for n in (192, 1536)] == [132, 132]
    monkeypatch.setattr(moe_lut, "RING_ONE_ROW_SMS", None)
    assert moe_lut._ring_grid(192, dev, 1)[0] == 132


def test_lut_spread_gate_up_is_taken_by_rows(monkeypatch):
    """moe_lut.spread_rows: the spread gate-up for the row counts in SPREAD_ROWS (2 measured to gain,
    1 not), whole items elsewhere; a SPREAD_ROWS entry above 2 is refused (the kernel stages 2 x rows)."""
    from megastep.kernels import moe_lut

    assert [moe_lut.spread_rows(torch.zeros(m * 6), 6) for m in (1, 2, 4, 16)] == [0, 2, 0, 0]
    monkeypatch.setattr(moe_lut, "SPREAD_ROWS", (1, 2))
    assert [moe_lut.spread_rows(torch.zeros(m * 8), 8) for m in (1, 2, 3)] == [1, 2, 0]
    monkeypatch.setattr(moe_lut, "SPREAD_ROWS", (4,))
    with pytest.raises(AssertionError):
        moe_lut.spread_rows(torch.zeros(24), 6)


def test_lut_signatures_match_the_kernels():
    """moe_lut.py passes as many arguments as each kernel in moe_lut.cu declares, typed by position."""
    from megastep.kernels import moe_lut

    for kernel in (moe_lut._GATE_UP, moe_lut._DOWN, moe_lut._GATE_UP_SPREAD, moe_lut._GATE_UP_RING,
                   moe_lut._GATE_UP_SPREAD_RING, moe_lut._GATE_UP_RING_MIX, moe_lut._GATE_UP_SPREAD_RING_MIX,
                   moe_lut._DOWN4, moe_lut._GATE_UP_GM, moe_lut._GATE_UP_GM_SPREAD, moe_lut._GATE_UP_GM_FEW,
                   moe_lut._DOWN_GM, moe_lut._DOWN_GM_EARLY):
        assert_signature_matches(moe_lut.SOURCE, kernel)
    # the items the launches count are the kernels' own: 8 (gate-up) or 16 (down) MMA rows a warp
    src = open(moe_lut.SOURCE).read()
    warps = int(re.search(r"constexpr int kWarps = (\d+);", src).group(1))
    assert (moe_lut.ITEM_CHANNELS, moe_lut.ITEM_ROWS) == (8 * warps, 16 * warps)
    # the spread gate-up's CTA: as many warps as the launch gives threads
    assert moe_lut.SPREAD_WARPS == int(re.search(r"constexpr int kSpreadWarps = (\d+);", src).group(1))
    # the ring launches' shared memory counts the .cu's slots
    assert moe_lut.RING_DEPTH == int(re.search(r"constexpr int kRingDepth = (\d+);", src).group(1))
    # and the ring's mixed decode's x block exponents after the table: 2 halves x 2 rows x 64 blocks of 4 B
    exp_bytes = re.search(r"constexpr int kExpBytes = ([\d *]+);", src).group(1)
    assert moe_lut.EXP_BYTES == eval(exp_bytes) == 1024, exp_bytes
    # the group-major gate-up's CTA, pass, ring and x rows, as its launch and shared memory count them
    names = ("kGmWarps", "kGmPairs", "kGmDepth", "kGmPad", "kGmDownDepth", "kGmFewWarps", "kGmFewRows")
    gm = {n: int(re.search(rf"\b{n} = (\d+)[,;]", src).group(1)) for n in names}
    assert (moe_lut.GM_WARPS, moe_lut.GM_PAIRS, moe_lut.GM_DEPTH, moe_lut.GM_PAD, moe_lut.GM_DOWN_DEPTH,
            moe_lut.GM_FEW_WARPS, moe_lut.GM_FEW_ROWS_MAX) == tuple(gm.values()), gm
