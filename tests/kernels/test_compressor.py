"""compressor_step against compressor_step_ref (FastDecoder._compress's code) over consecutive
decode steps at tiny shapes (dim 64 with 16 RoPE dims): the overlapping CSA compressor (r = 4,
kinds 'kv' and 'index'), a non-overlapping one (r = 16), HCA's r = 128 from a filled state; rows
that do and do not close a window in the same step, a padding row on the dummy slot, both RoPE
forms, one and several channel blocks per row (the arrival-counter finish); batch invariance
and determinism.

Tolerances (why): the state pools are copies and must be bit-equal. Entries go through fp32 sums
in another order (softmax denominator, weighted sum over rows, sum of squares) and exp/cos/sin
within an ulp of torch's (the interpreter's float64-rounded ones against SLEEF; see
test_rope_norm), then through bf16 roundings that hide almost all of it: they must be bit-equal
in >= 99% of the elements and the rest within one simulation grid step. Observed: all equal.
"""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    for _m in ("megastep.kernels.rope_norm", "megastep.kernels.compressor"):  # imported before the interpreter was set
        if _m in sys.modules:
            importlib.reload(sys.modules[_m])

from megastep.config import ModelConfig  # noqa: E402
from megastep.kernels import compressor as C  # noqa: E402
from megastep.kernels import rope_norm as rn  # noqa: E402
from megastep.model import ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def inv_freq(rd: int, dev=DEV) -> torch.Tensor:
    return ops.rope_inv_freq(ModelConfig().replace(qk_rope_head_dim=rd), True).to(dev)


def check_entries(y: torch.Tensor, ref: torch.Tensor, kind: str, min_equal: float = 0.99) -> None:
    y, ref = y.cpu().float(), ref.cpu().float()
    assert torch.isfinite(y).all()
    neq = y != ref
    assert neq.sum().item() <= max(2, (1 - min_equal) * y.numel()), f"{neq.sum().item()} of {y.numel()} differ"
    # one grid step: e4m3 steps are 2^-3 relative (2^-2 around a block's amax crossing); e2m1 up to 2x
    rel = 0.5 if kind == "kv" else 2.0
    ok = (y - ref).abs() <= rel * ref.abs().clamp_min(1e-30) + 1e-6 * ref.abs().max()
    assert (ok | ~neq).all(), (y[neq & ~ok], ref[neq & ~ok])


class Case:
    """Pools for S slots (the last one the dummy) and a ref copy; rows start at given positions."""

    def __init__(self, r, overlap, kind, dim, rd, S, n_entries, seed, dtype=torch.bfloat16, filled=False, dev=DEV):
        self.r, self.overlap, self.kind, self.dim = r, overlap, kind, dim
        coff = 2 if overlap else 1
        self.g = torch.Generator().manual_seed(seed)
        if filled:  # a state in mid-window: random values and finite scores in every row
            kvp = torch.randn(S, coff * r, coff * dim, generator=self.g)
            scp = torch.randn(S, coff * r, coff * dim, generator=self.g) * 2
        else:  # fresh slots (StatePools.reset)
            kvp = torch.zeros(S, coff * r, coff * dim)
            scp = torch.full_like(kvp, float("-inf"))
        ent = torch.randn(S, n_entries + 1, dim, generator=self.g).to(dtype)  # stale entries must survive
        self.st = [t.to(dev) for t in (kvp, scp, ent)]
        self.st_ref = [t.clone() for t in self.st]
        self.w = (torch.rand(dim, generator=self.g) + 0.5).to(dev)
        self.ape = (torch.randn(r, coff * dim, generator=self.g) * 0.5).to(dev)
        self.rope = inv_freq(rd, dev)

    def inputs(self, B):
        coff = 2 if self.overlap else 1
        kv = torch.randn(B, coff * self.dim, generator=self.g) * 2
        sc = torch.randn(B, coff * self.dim, generator=self.g) * 3  # scores + ape
        return kv.to(DEV), sc.to(DEV)

    def step(self, kv, sc, slots, pos, rope=None, cfg=None, ref=True, ape=False):
        """sc: wgate.x + ape[pos % r], or wgate.x alone with ape=True (the kernel adds it)."""
        rope = self.rope if rope is None else rope
        a = self.ape if ape else None
        C.compressor_step(kv, sc, *self.st, slots, pos, self.w, rope, self.r, self.overlap, self.kind, EPS, ape=a,
                          config=cfg)
        if ref:
            C.compressor_step_ref(kv, sc, *self.st_ref, slots, pos, self.w, rope, self.r, self.overlap, self.kind, EPS,
                                  ape=a)

    def compare(self, real_slots):
        n = self.st[2].shape[1] - 1
        for a, b in zip(self.st[:2], self.st_ref[:2]):
            assert torch.equal(a[real_slots], b[real_slots])
        check_entries(self.st[2][real_slots, :n], self.st_ref[2][real_slots, :n], self.kind)


@pytest.mark.parametrize("r,overlap,kind", [(4, True, "kv"), (4, True, "index"), (16, False, "kv")])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("bc", [None, 16])
def test_consecutive_steps_match_ref(r, overlap, kind, B, bc):
    S = 4
    case = Case(r, overlap, kind, 64, 16, S, n_entries=8, seed=r * 10 + B + (bc or 0))
    dummy = S - 1
    slots = torch.tensor([0, 2, dummy][:B] if B == 3 else [1], device=DEV)
    # staggered starts: in a step some rows close a window and others do not
    start = torch.tensor([0, 2, 5][:B] if B == 3 else [0], device=DEV)
    steps = 2 * r + 3 if r <= 4 else r + 3
    stale = case.st[2].clone()
    for t in range(steps):
        kv, sc = case.inputs(B)
        case.step(kv, sc, slots, start + t, cfg=C.CompressorConfig(bc) if bc else None, ape=bc is None)
        case.compare(slots[slots != dummy])
    assert not torch.equal(case.st[2][slots[0], 0], stale[slots[0], 0])  # an entry was emitted


def test_table_rope_and_fp32_entries():
    """The RoPE table path (bit-exact cos/sin), and fp32 entries (no bf16 rounding anywhere)."""
    for dtype, kind in ((torch.bfloat16, "kv"), (torch.float32, "index")):
        case = Case(4, True, kind, 64, 16, 3, n_entries=4, seed=5, dtype=dtype)
        table = rn.rope_table(case.rope, 32)
        slots = torch.tensor([0, 1], device=DEV)
        for t in range(9):
            kv, sc = case.inputs(2)
            case.step(kv, sc, slots, torch.tensor([t, t + 1], device=DEV), rope=table)
            for a, b in zip(case.st[:2], case.st_ref[:2]):
                assert torch.equal(a, b)
            n = case.st[2].shape[1] - 1
            if dtype == torch.bfloat16:
                assert torch.equal(case.st[2][:, :n], case.st_ref[2][:, :n])
            else:  # fp32 sums in another order, nothing rounds them away
                check_entries(case.st[2][:, :n], case.st_ref[2][:, :n], kind, min_equal=0.0)


@pytest.mark.parametrize("bc", [None, 16])
def test_hca_ratio_128_from_filled_state(bc):
    """r = 128 (HCA, no overlap): a filled state, rows closing their window (pos 127, 255) and one
    mid-window row; pooled tiles [128, block_c]."""
    case = Case(128, False, "kv", 64, 16, 4, n_entries=3, seed=11, filled=True)
    slots = torch.tensor([2, 0, 1], device=DEV)
    pos = torch.tensor([127, 255, 300], device=DEV)
    kv, sc = case.inputs(3)
    stale = case.st[2].clone()
    case.step(kv, sc, slots, pos, cfg=C.CompressorConfig(bc) if bc else None)
    case.compare(slots)
    assert not torch.equal(case.st[2][2, 0], stale[2, 0]) and not torch.equal(case.st[2][0, 1], stale[0, 1])
    assert torch.equal(case.st[2][1], stale[1])  # the open window emitted nothing


def test_batch_invariant_and_deterministic():
    """A row alone gives the bits it gives in a batch (its own slot's state and entries), two runs
    give the same bits, and so does adding ape outside, for one and several channel blocks."""
    for bc in (None, 16):
        cfg = C.CompressorConfig(bc) if bc else None
        full = Case(4, True, "kv", 64, 16, 5, n_entries=4, seed=21)
        alone = Case(4, True, "kv", 64, 16, 5, n_entries=4, seed=21)
        again = Case(4, True, "kv", 64, 16, 5, n_entries=4, seed=21)
        added = Case(4, True, "kv", 64, 16, 5, n_entries=4, seed=21)
        slots = torch.tensor([3, 1, 0, 4], device=DEV)
        for t in range(6):
            kv, sc = full.inputs(4)
            pos = torch.tensor([t, t + 1, t + 3, 0], device=DEV)
            full.step(kv, sc, slots, pos, cfg=cfg, ref=False, ape=True)
            again.step(kv, sc, slots, pos, cfg=cfg, ref=False, ape=True)
            alone.step(kv[2:3], sc[2:3], slots[2:3], pos[2:3], cfg=cfg, ref=False, ape=True)
            added.step(kv, sc + added.ape[pos % 4], slots, pos, cfg=cfg, ref=False)  # ape added outside
        for a, b, c, d in zip(full.st, again.st, alone.st, added.st):
            assert torch.equal(a, b) and torch.equal(a, d)
            assert torch.equal(a[0], c[0])


# ---- GPU, real shapes -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("r,overlap,kind,dim", [(4, True, "kv", 512), (4, True, "index", 128), (128, False, "kv", 512)])
def test_gpu_v4_shapes(B, r, overlap, kind, dim):
    S = B + 1
    case = Case(r, overlap, kind, dim, 64, S, n_entries=64, seed=B + r, filled=True, dev="cuda")
    slots = torch.randperm(S, device="cuda")[:B]
    base = torch.randint(0, 32, (B,), device="cuda") * r
    for t in range(r - 2, r + 2) if r <= 4 else (r - 1, r):
        kv, sc = case.inputs(B)
        pos = base + t + torch.arange(B, device="cuda") % 2  # half the rows close a window per step
        case.step(kv, sc, slots, pos)
        case.compare(slots)
    # determinism and batch invariance on the final state
    kv, sc = case.inputs(B)
    pos = base + 2 * r - 1
    states = [[t.clone() for t in case.st] for _ in range(3)]
    for st, rows in zip(states, (slice(0, B), slice(0, B), slice(0, 1))):
        C.compressor_step(kv[rows], sc[rows], *st, slots[rows], pos[rows], case.w, case.rope, r, overlap, kind, EPS)
    s0 = slots[0]
    for a, b, c in zip(*states):
        assert torch.equal(a, b) and torch.equal(a[s0], c[s0])


@pytest.mark.parametrize("r,overlap,kind,dim", [(4, True, "kv", 512), (4, True, "index", 128), (128, False, "kv", 512)])
def test_v4_widths_on_cpu(r, overlap, kind, dim):
    """The V4-Flash widths with the pinned configurations (one [8, 512] / [8, 128] tile per row;
    16 channel blocks of [128, 32] for HCA), from a filled state: one row closes its window, one
    does not."""
    case = Case(r, overlap, kind, dim, 64, 3, n_entries=4, seed=r + dim, filled=True)
    slots = torch.tensor([1, 0], device=DEV)
    pos = torch.tensor([2 * r - 1, r + 1], device=DEV)
    kv, sc = case.inputs(2)
    case.step(kv, sc, slots, pos, ape=True)
    case.compare(slots)
