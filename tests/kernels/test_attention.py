"""sparse_attention_decode against ops.sparse_attention: random inputs, ragged N (masked tails,
fully masked chunks), garbage in masked rows, every configuration the wrapper picks plus odd
ones, batch invariance and determinism. sparse_attention_pools against its ref (gathers, cats,
ops.sparse_attention, inverse RoPE) for SWA, CSA and HCA layers: partially filled rings, rows
without visible compressed entries, repeated slots, both RoPE forms, split and unsplit.

Tolerance: scores are exact-product fp32 dots; the weighted sum uses the softmax weights split
into bf16 pieces (error <= 2^-17 relative with two pieces) and the online-softmax rescaling, so
the kernel and the ref differ at fp32 noise level: outputs must be at most one bf16 step from
the ref (or within 1e-5 max|ref| where the weighted sum cancels) and bit-equal in >= 99%.
"""

import importlib
import os
import sys

from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.attention" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.attention"])  # imported before the interpreter was set

from megastep.kernels.attention import (_PINNED_FEW_ROWS, AttnConfig, pick_config, same_bits,  # noqa: E402
                                        sparse_attention_decode, sparse_attention_decode_ref,
                                        sparse_attention_pools, sparse_attention_pools_ref)
from megastep.kernels.rope_norm import rope_table  # noqa: E402
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
         AttnConfig(64, 32, 96), AttnConfig(16, 16, 32, dv_split=2), AttnConfig(32, 16, 128, dv_split=2)]


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


# ---- sparse_attention_pools ---------------------------------------------------------------------
# (ratio, n, k): SWA, CSA (ratio 4, top-k of n entries), HCA (every visible one of n entries)
LAYERS = {"swa": (0, 0, 0), "csa": (4, 20, 6), "hca": (8, 12, 0)}
# ring partly filled (W = 12) and full; no / some / all compressed entries visible, one emitted at
# this step ((pos + 1) % ratio == 0) or one step before that
POS = [0, 6, 7, 12, 39, 79]


def make_pools(kind, seed, B=6, H=6, d=64, rd=16, W=12, S=4, table=False, pos=POS, dev=DEV):
    """Pools with random (finite) data everywhere, including unused rows and the discard row."""
    ratio, n, k = LAYERS[kind]
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rows(*shape):
        return (torch.randn(*shape, d, generator=g) * torch.exp2(torch.randint(-2, 2, (*shape, 1), generator=g).float())).bfloat16()

    q = (torch.randn(B, H, d, generator=g) * 2).bfloat16()
    window = rows(S, W)
    slots = torch.randint(0, S, (B,), generator=g)
    if B > 1:
        slots[1] = slots[0]  # repeated use of a slot
    pos_t = torch.tensor(pos[:B], dtype=torch.int64)
    sink = torch.randn(H, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    rope = rope_table(inv_freq, int(pos_t.max()) + 1) if table else inv_freq
    kw = dict(ratio=ratio)
    if ratio:
        comp = rows(S, n + 1)
        comp[:, n] = 1e30  # the discard row
        kw["comp"] = comp
        if k:  # the indexer's top-k: every visible entry first (ascending), then invisible ones
            vis = (pos_t + 1) // ratio
            idx = torch.stack([torch.cat([torch.randperm(int(v), generator=g)[:k].sort().values,
                                          int(v) + torch.randperm(n - int(v), generator=g)[:max(0, k - int(v))].sort().values])
                               for v in vis])
            kw["idx"], kw["idx_ok"] = idx, idx < vis[:, None]
    args = (q, window, slots, pos_t, sink, d**-0.5, rope)
    return tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in args), {
        key: t.to(dev) if isinstance(t, torch.Tensor) else t for key, t in kw.items()}


def rows_of(args, kw, sel):
    """The inputs of the batch rows `sel` alone."""
    q, window, slots, pos, sink, scale, rope = args
    kw = dict(kw)
    for key in ("idx", "idx_ok"):
        if key in kw:
            kw[key] = kw[key][sel]
    return (q[sel], window, slots[sel], pos[sel], sink, scale, rope), kw


def check_out(y, ref, rd):
    """check() on the nope dims; on the RoPE dims the inverse rotation of a bf16 o that is one step
    off (the attention's tolerance) can be many steps off where the rotation cancels: there at most
    2^-5 of the larger value of the pair off, and bit-equal in >= 99% (the rotation itself is
    pinned bit-exactly by test_pools_rotation_exact)."""
    check(y[..., :-rd], ref[..., :-rd])
    y, ref = y[..., -rd:].float().cpu(), ref[..., -rd:].float().cpu()
    mag = ref.unflatten(-1, (-1, 2)).abs().amax(-1, keepdim=True).expand(*ref.shape[:-1], rd // 2, 2).flatten(-2)
    assert ((y - ref).abs() <= 2**-5 * mag).all(), (y - ref).abs().max()
    assert (y != ref).sum().item() <= max(2, 0.01 * y.numel())


SPLIT_CFG = AttnConfig(16, 16, 16)  # entries 0..15 per program: window and compressed rows share a tile


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("table", [False, True], ids=["inv_freq", "table"])
@pytest.mark.parametrize("cfg", [None, SPLIT_CFG], ids=["picked", "split"])
def test_pools_match_ref(kind, table, cfg):
    args, kw = make_pools(kind, seed=len(kind) + table, table=table)
    o = sparse_attention_pools(*args, **kw, config=cfg)
    check_out(o, sparse_attention_pools_ref(*args, **kw), 16)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_pools_wide_heads(kind):
    """d = 256: the combine stores the output in two column slabs, RoPE in the second one only."""
    args, kw = make_pools(kind, seed=7, H=4, d=256, rd=32)
    check_out(sparse_attention_pools(*args, **kw, config=SPLIT_CFG), sparse_attention_pools_ref(*args, **kw), 32)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("cfg", [None, SPLIT_CFG], ids=["picked", "split"])
def test_pools_rotation_exact(kind, cfg):
    """Where the attention is exact (q = 0 and every entry of a slot the same row v, no sink
    weight: o = v), the output is exactly the torch inverse rotation of v at each row's position."""
    args, kw = make_pools(kind, seed=9, table=True, pos=[0, 6, 7, 12, 39, 79])
    q, window, slots, pos, sink, scale, rope = args
    v = window[:, :1]
    window = v.expand(window.shape).contiguous()
    if "comp" in kw:
        kw["comp"] = v.expand(kw["comp"].shape).contiguous()
    q, sink = torch.zeros_like(q), torch.full_like(sink, float("-inf"))
    o = sparse_attention_pools(q, window, slots, pos, sink, scale, rope, **kw, config=cfg)
    expect = sparse_attention_pools_ref(q, window, slots, pos, sink, scale, rope, **kw)
    assert torch.equal(expect[..., :-16], v[slots].expand(-1, q.shape[1], -1)[..., :-16])  # the premise
    assert torch.equal(o, expect)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_combine_settings_change_no_bits(kind):
    """How many chunk partials the combine loads at once and how wide its column slabs are only
    change what is in flight: the same bits (several chunks, a group that does not divide them,
    slabs narrower than the RoPE'd tail and the whole row)."""
    args, kw = make_pools(kind, seed=13, H=4, d=256, rd=32)
    base = sparse_attention_pools(*args, **kw, config=SPLIT_CFG)
    for group, cols in ((1, 32), (3, 64), (16, 256), (64, 512)):
        cfg = replace(SPLIT_CFG, combine_group=group, combine_cols=cols)
        assert torch.equal(sparse_attention_pools(*args, **kw, config=cfg), base), (group, cols)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("dv_split", [2, 4, 8])
@pytest.mark.parametrize("chunk", [16, 64], ids=["split", "unsplit"])
def test_value_split(kind, dv_split, chunk):
    """Programs that split the value columns (each its own scores over all d, its slab of the
    weighted sum, its own partials, counter and combine): the ref's result, RoPE'd tail in the
    last slab only; the same bits as the unsplit kernel (the same sums per column); batch
    invariant and deterministic."""
    args, kw = make_pools(kind, seed=21 + dv_split, H=20, d=256, rd=32)
    base_cfg = AttnConfig(16, 16, chunk)
    cfg = replace(base_cfg, dv_split=dv_split, num_stages=3)
    assert same_bits(cfg, base_cfg)
    o = sparse_attention_pools(*args, **kw, config=cfg)
    check_out(o, sparse_attention_pools_ref(*args, **kw), 32)
    assert torch.equal(o, sparse_attention_pools(*args, **kw, config=base_cfg))
    assert torch.equal(o, sparse_attention_pools(*args, **kw, config=cfg))
    a, k = rows_of(args, kw, slice(3, 4))
    assert torch.equal(sparse_attention_pools(*a, **k, config=cfg), o[3:4])


def test_few_rows_plans_keep_the_sums():
    """A step of few rows may take another launch plan for a shape, never other sums: each entry
    of _PINNED_FEW_ROWS differs from the shape's configuration only in bit-neutral settings."""
    assert _PINNED_FEW_ROWS
    for (H, N, d), (rows, cfg) in _PINNED_FEW_ROWS.items():
        base = pick_config(H, N, d)
        assert base == pick_config(H, N, d, rows + 1) and cfg == pick_config(H, N, d, rows) == pick_config(H, N, d, 1)
        assert same_bits(cfg, base) and cfg != base
    base = AttnConfig(16, 32, 64)
    # num_warps too: on the H200, 4 instead of 8 warps moved 2 of 8 x 64 x 512 CSA outputs by a bf16 step
    for change in (dict(block_n=16), dict(chunk=32), dict(block_h=32), dict(pv_pieces=3), dict(num_warps=4)):
        assert not same_bits(replace(base, **change), base), change


def test_register_cap_is_bit_neutral_and_checked():
    """A register cap changes how ptxas allocates, not what is computed: listed among the
    bit-neutral settings, the same output (on the GPU a real check; the interpreter ignores it)."""
    base = AttnConfig(16, 32, 64)
    assert same_bits(replace(base, maxnreg=128), base)
    for bad in (16, 300):
        with pytest.raises(AssertionError):
            replace(base, maxnreg=bad).check()
    args, kw = make_pools("csa", seed=21)
    o = sparse_attention_pools(*args, **kw, config=SPLIT_CFG)
    assert torch.equal(sparse_attention_pools(*args, **kw, config=replace(SPLIT_CFG, maxnreg=128)), o)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_pools_batch_invariant_and_deterministic(kind):
    args, kw = make_pools(kind, seed=11)
    full = sparse_attention_pools(*args, **kw, config=SPLIT_CFG)
    assert torch.equal(full, sparse_attention_pools(*args, **kw, config=SPLIT_CFG))
    for sel in (slice(0, 1), slice(3, 4), slice(5, 6), slice(1, 3)):
        a, k = rows_of(args, kw, sel)
        assert torch.equal(sparse_attention_pools(*a, **k, config=SPLIT_CFG), full[sel])


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_pools_masked_rows_are_not_read(kind):
    """NaN in every pool row that no batch row may attend (ring slots past a position, invisible
    or unselected compressed entries, the discard row, unused slots): the same bits."""
    args, kw = make_pools(kind, seed=12)
    q, window, slots, pos, sink, scale, rope = args
    ratio, n, _ = LAYERS[kind]
    keep_w = torch.zeros(window.shape[:2], dtype=torch.bool, device=window.device)
    keep_c = torch.zeros(kw["comp"].shape[:2], dtype=torch.bool, device=window.device)
    for b in range(q.shape[0]):
        keep_w[slots[b], : int(pos[b]) + 1] = True
        if "idx" in kw:
            keep_c[slots[b], kw["idx"][b][kw["idx_ok"][b]]] = True
        else:
            keep_c[slots[b], : (int(pos[b]) + 1) // ratio] = True
    nan = torch.tensor(float("nan"), dtype=window.dtype, device=window.device)
    dirty_w = torch.where(keep_w[..., None], window, nan)
    dirty = dict(kw, comp=torch.where(keep_c[..., None], kw["comp"], nan))
    for cfg in (None, SPLIT_CFG):
        o = sparse_attention_pools(q, dirty_w, slots, pos, sink, scale, rope, **dirty, config=cfg)
        assert torch.equal(o, sparse_attention_pools(*args, **kw, config=cfg))


def test_pools_strided_pools_and_int32_ids():
    """Pools as views of larger buffers (strided slots and rows), int32 top-k ids."""
    args, kw = make_pools("csa", seed=13)
    q, window, slots, pos, sink, scale, rope = args
    wb = torch.zeros(window.shape[0], window.shape[1] + 3, 96, dtype=window.dtype, device=window.device)
    wb[:, 2:-1, :64] = window
    cb = torch.zeros(kw["comp"].shape[0], kw["comp"].shape[1], 80, dtype=window.dtype, device=window.device)
    cb[..., 16:] = kw["comp"]
    o = sparse_attention_pools(q, wb[:, 2:-1, :64], slots, pos, sink, scale, rope,
                               **dict(kw, comp=cb[..., 16:], idx=kw["idx"].int()))
    assert torch.equal(o, sparse_attention_pools(*args, **kw))


def test_pools_rows_off_16_bytes_take_no_alignment_hint(monkeypatch):
    """The launcher states the KV rows' 16-byte alignment (ROWS16) only when every row starts on
    16 bytes: pool views at odd element offsets are launched without it (on the GPU the hint would
    make them load 16 bytes at a time from misaligned rows) and give the same bits."""
    import megastep.kernels.attention as A

    kernel, seen = A._sparse_attn_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **k):
                seen.append(k["ROWS16"])
                return kernel[grid](*a, **k)
            return launch

    monkeypatch.setattr(A, "_sparse_attn_kernel", Spy())
    args, kw = make_pools("csa", seed=17)
    q, window, slots, pos, sink, scale, rope = args
    aligned = sparse_attention_pools(*args, **kw)
    wb = torch.zeros(*window.shape[:2], 72, dtype=window.dtype, device=window.device)
    wb[..., 1:65] = window
    cb = torch.zeros(*kw["comp"].shape[:2], 80, dtype=window.dtype, device=window.device)
    cb[..., 3:67] = kw["comp"]
    o = sparse_attention_pools(q, wb[..., 1:65], slots, pos, sink, scale, rope, **dict(kw, comp=cb[..., 3:67]))
    assert seen == [True, False]
    assert torch.equal(o, aligned)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key", sorted(_PINNED_FEW_ROWS), ids=str)
def test_gpu_few_rows_plan_same_bits(key):
    """On the device too, the few-rows plan of a V4 shape gives the bits of the shape's
    configuration, at 1 row and at its largest row count (several positions, both RoPE forms)."""
    H, N, d = key
    rows, few = _PINNED_FEW_ROWS[key]
    base = pick_config(H, N, d)
    LAYERS_V4 = {"swa": (0, 0, 0), "csa": (4, 2048, N - 128), "hca": (128, N - 128, 0)}
    kind = "swa" if N == 128 else "csa" if N == 640 else "hca"
    old = LAYERS[kind]
    LAYERS[kind] = LAYERS_V4[kind]
    try:
        for B in sorted({1, rows}):
            for table in (False, True):
                pos = [3] + [1000 * (i + 1) + 7 * i for i in range(B - 1)]
                args, kw = make_pools(kind, seed=B + 40, B=B, H=H, d=d, rd=64, W=128, S=max(B, 2), table=table,
                                      pos=pos, dev="cuda")
                o = sparse_attention_pools(*args, **kw)  # picks `few` at these row counts
                assert torch.equal(o, sparse_attention_pools(*args, **kw, config=few))
                assert torch.equal(o, sparse_attention_pools(*args, **kw, config=base)), (B, table)
    finally:
        LAYERS[kind] = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_pools_v4_shapes(B, kind):
    """V4-Flash: 64 heads of 512 (RoPE on the last 64), a ring of 128, CSA top-512 of 2048
    entries, HCA 512 entries (ratio 128); positions across the whole range."""
    g = torch.Generator().manual_seed(B)
    LAYERS_V4 = {"swa": (0, 0, 0), "csa": (4, 2048, 512), "hca": (128, 512, 0)}
    ratio, n, k = LAYERS_V4[kind]
    pos = torch.randint(0, max(n * max(ratio, 1), 256), (B,), generator=g).tolist()
    pos[0] = 3
    old = LAYERS[kind]
    LAYERS[kind] = LAYERS_V4[kind]
    try:
        for table in (False, True):
            args, kw = make_pools(kind, seed=B, B=B, H=64, d=512, rd=64, W=128, S=max(B, 2), table=table, pos=pos,
                                  dev="cuda")
            o = sparse_attention_pools(*args, **kw)
            assert torch.equal(o, sparse_attention_pools(*args, **kw))
            a1, k1 = rows_of(args, kw, slice(0, 1))
            assert torch.equal(o[:1], sparse_attention_pools(*a1, **k1))
            check_out(o, sparse_attention_pools_ref(*args, **kw), 64)
    finally:
        LAYERS[kind] = old


@pytest.mark.parametrize("cfg", [None, SPLIT_CFG], ids=["picked", "split"])
def test_pools_ring_longer_than_window(cfg):
    """A multi-token block: the ring holds W + 3 slots, positions up to 3 past a row's own were
    written, and each row must see exactly positions max(0, pos - WA + 1) .. pos. Checked against
    ops.sparse_attention over those positions' keys listed directly (no ring arithmetic)."""
    from megastep.model import ops

    WA, extra, H, d, rd = 8, 3, 4, 32, 8
    R = WA + extra
    g = torch.Generator(device="cpu").manual_seed(7)
    last = [2, 5, 9, 13, 30]  # the last position written per sequence (slot)
    keys = [(torch.randn(p + 1, d, generator=g)).bfloat16() for p in last]  # kv of positions 0..p
    window = torch.randn(len(last), R, d, generator=g).bfloat16()  # junk where nothing was written
    for s, k in enumerate(keys):
        for q_pos in range(k.shape[0]):
            window[s, q_pos % R] = k[q_pos]
    rows = [(s, p) for s, lp in enumerate(last) for p in range(max(0, lp - extra), lp + 1)]  # rows of a block
    slots = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    q = (torch.randn(len(rows), H, d, generator=g) * 2).bfloat16()
    sink = torch.randn(H, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    args = tuple(t.to(DEV) for t in (q, window, slots, pos, sink)) + (d**-0.5, inv_freq.to(DEV))
    y = sparse_attention_pools(*args, window_size=WA, config=cfg)
    y_ref = sparse_attention_pools_ref(*args, window_size=WA)
    for i, (s, p) in enumerate(rows):
        kv = keys[s][max(0, p - WA + 1): p + 1][None]
        o = ops.sparse_attention(q[i:i + 1], kv, sink, d**-0.5, torch.ones(1, kv.shape[1], dtype=torch.bool))
        want = ops.apply_rope(o, inv_freq, torch.tensor([p]), inverse=True)
        check_out(y_ref[i:i + 1].cpu(), want, rd)
        check_out(y[i:i + 1].cpu(), want, rd)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("world", [2, 4])
def test_pools_a_ranks_heads_take_the_full_launchs_bits(kind, world):
    """Tensor parallelism (FastDecoder(attn_split=True)): a rank's block of heads with
    heads_like = every head runs the full launch's configuration (here 32-head programs, of which
    the rank fills 16 or 8) and gives those heads' bits of the full launch."""
    H = 32
    args, kw = make_pools(kind, seed=21 + world, H=H, d=64)
    q, window, slots, pos, sink, scale, rope = args
    whole = sparse_attention_pools(*args, **kw)
    Hl = H // world
    for r in range(world):
        heads = slice(r * Hl, (r + 1) * Hl)
        got = sparse_attention_pools(q[:, heads].contiguous(), window, slots, pos, sink[heads].contiguous(), scale,
                                     rope, **kw, heads_like=H)
        assert torch.equal(got, whole[:, heads]), (world, r)
