"""wo_tail (the attention sublayer's wo_a -> wo_b in one persistent CUDA C++ launch): it builds without
spills and the Python side passes what the .cu takes, its constants agree, which operands it takes
(CPU, nvcc); its reference is the step's two linears; on a GPU, linear_fp8's two launches' bits at
the V4-Flash and small shapes, rows 1-4, every entry, with and without PDL, on grids of any size,
replayed from a graph, and in the step."""

import os
import re
import sys
import types

import pytest
import torch

from megastep.checkpoint import formats as F
from megastep.kernels import common
from megastep.kernels import linear_fp8 as LIN
from megastep.kernels import wo_tail as WT
from megastep.kernels.cuda_module import find_nvcc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_checks import assert_builds_without_spills, assert_signature_matches  # noqa: E402
from test_linear_fp8 import check, make  # noqa: E402

KERNELS = tuple(k.name for k in WT._KERNELS.values())
V4 = (8, 1024, 4096, 4096)  # G, R, Ka, N
SMALL = (4, 256, 2048, 1024)


def gpu(test):
    """A test that needs a CUDA device and nvcc."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                 pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")):
        test = mark(test)
    return test


def operands(M, G, R, Ka, N, seed, dev):
    """o [M, G Ka] bf16, wo_a [G R, Ka] and wo_b [N, G R] in e4m3 with their e8m0 scales."""
    o, wa, sa = make(M, G * R, G * Ka, seed=seed, dev=dev)
    wa, sa = F.quantize_fp8_weight(F.dequantize_fp8_weight(wa, sa, 128)[:, :Ka], 128)  # each group its Ka columns
    _, wb, sb = make(1, N, G * R, seed=seed + 1, dev=dev)
    return o, wa, sa, wb, sb


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_builds_for_sm90_without_spills():
    assert_builds_without_spills(WT.SOURCE, KERNELS)


def test_signatures_match_the_source():
    """The entries are instantiated by one macro (their names pasted from NW, NR and NKC), so its
    parameter list is what each launch must match; the source instantiates exactly ENTRIES."""
    assert {k.signature for k in WT._KERNELS.values()} == {WT._SIGNATURE}
    entry = types.SimpleNamespace(name="wo_tail_w##NW##_r##NR##_kc##NKC", signature=WT._SIGNATURE)
    assert_signature_matches(WT.SOURCE, entry)
    src = open(WT.SOURCE).read()
    made = {tuple(int(v) for v in m) for m in re.findall(r"^WO_TAIL_ENTRY\((\d+), (\d+), (\d+)\)$", src, re.M)}
    assert made == set(WT.ENTRIES)


def test_constants_agree_with_the_source():
    """The Python side's sizes (shared memory, workspaces, counters) use the .cu's constants."""
    src = open(WT.SOURCE).read()

    def const(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))

    assert (const("kRows"), const("kPad"), const("kQueue"), const("kMaxGroups")) == \
           (WT.MAX_ROWS, WT._PAD, WT._QUEUE, WT.MAX_GROUPS)
    assert re.search(r"kGroupDone = 2, kTileArrivals = 2 \+ kMaxGroups;", src)
    G, R, _, N = V4
    assert WT.sync_words(G, R, N) == 2 + WT.MAX_GROUPS + G * R // 16 + N // 16


def test_every_entry_fits_one_hopper_cta_with_its_ring():
    for e in WT.ENTRIES:
        w, r, kc = e
        assert r + 1 <= WT._QUEUE and kc % 128 == 0, e
        assert WT.shared_bytes(e) <= 227 << 10, (e, WT.shared_bytes(e))  # the grid (a CTA per SM) fits at once


def test_ref_is_the_steps_two_linears():
    """wo_tail_ref is what the step computes without it: Linear.grouped (wo_a) then Linear (wo_b)
    through linear_fp8's reference."""
    from megastep.model.linears import Linear

    G, R, Ka, N = 2, 128, 256, 128
    o, wa, sa, wb, sb = operands(3, G, R, Ka, N, seed=3, dev="cpu")
    y = WT.wo_tail_ref(o, wa, sa, wb, sb, G)
    u = LIN.linear_fp8_ref(o, wa, sa, quantize_act=False, groups=G)
    assert torch.equal(y, LIN.linear_fp8_ref(u, wb, sb))
    step = Linear(wb, sb, 128, True)(Linear(wa, sa, 128, False).grouped(o.view(3, G, Ka), G, R, False), False)
    check(y, step)


def test_fits_takes_only_what_the_kernel_can(monkeypatch):
    """Operands on any device (meta: no memory): V4-Flash's at 1-4 rows with every entry; not 5
    rows, fp32 o, rows 8 bytes off 16, a foreign entry, a K split the sub-tile does not divide (the
    small preset's 128 columns a split with 256-byte sub-tiles), a wrong wo_b; plan() only when
    ENABLED and on CUDA."""
    G, R, Ka, N = V4

    def t(*shape, dtype=torch.float8_e4m3fn):
        return torch.empty(*shape, dtype=dtype, device="meta")

    wa, wb = t(G * R, Ka), t(N, G * R)
    for M in (1, 2, 3, 4):
        for e in WT.ENTRIES:
            assert WT.fits(t(M, G * Ka, dtype=torch.bfloat16), wa, wb, G, e) == e
    o = t(1, G * Ka, dtype=torch.bfloat16)
    assert WT.fits(t(5, G * Ka, dtype=torch.bfloat16), wa, wb, G, WT.ENTRY) is None
    assert WT.fits(t(1, G * Ka, dtype=torch.float32), wa, wb, G, WT.ENTRY) is None
    assert WT.fits(t(1, G * Ka + 4, dtype=torch.bfloat16)[:, :G * Ka], wa, wb, G, WT.ENTRY) is None
    assert WT.fits(o, wa, wb, G, (8, 5, 256)) is None
    assert WT.fits(o, wa, t(N, G * R + 128), G, WT.ENTRY) is None
    assert WT.fits(o, wa, wb, 32, WT.ENTRY) is None
    g, r, ka, n = SMALL  # splits of 128 columns: only the 128-byte sub-tiles
    so, swa, swb = t(1, g * ka, dtype=torch.bfloat16), t(g * r, ka), t(n, g * r)
    assert [WT.fits(so, swa, swb, g, e) for e in WT.ENTRIES] == [None] * 4 + [(8, 4, 128)]
    assert WT.splits(1, swa, swb) == (16, 8) and WT.splits(1, wa, wb) == (4, 8)
    monkeypatch.setattr(WT, "ENABLED", True)
    assert WT.plan(torch.zeros(1, G * Ka, dtype=torch.bfloat16), wa, wb, G) is None  # not CUDA
    monkeypatch.setattr(WT, "ENABLED", False)
    assert WT.plan(o, wa, wb, G) is None


def _pair(o, wa, sa, wb, sb, G):
    """linear_fp8's two Triton launches, as the step runs them without the tail."""
    return LIN.linear_fp8(LIN.linear_fp8(o, wa, sa, quantize_act=False, groups=G), wb, sb)


@gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("entry", WT.ENTRIES)
@pytest.mark.parametrize("shape", [V4, SMALL], ids=["v4", "small"])
def test_gpu_tail_gives_the_two_launches_bits(monkeypatch, shape, entry, M, pdl):
    G, R, Ka, N = shape
    monkeypatch.setattr(WT, "ENABLED", True)
    o, wa, sa, wb, sb = operands(M, G, R, Ka, N, seed=M + Ka, dev="cuda")
    if WT.plan(o, wa, wb, G, entry) is None:
        assert shape == SMALL and entry[2] > 128
        return
    old = common.set_pdl(pdl)
    try:
        want = _pair(o, wa, sa, wb, sb, G)
        y = WT.wo_tail(o, wa, sa, wb, sb, G, entry)
        y2 = WT.wo_tail(o, wa, sa, wb, sb, G, entry)
    finally:
        common.set_pdl(old)
    WT.check(o.device)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert torch.equal(y, y2)  # and the counters were put back
    check(y, WT.wo_tail_ref(o, wa, sa, wb, sb, G))


@gpu
@pytest.mark.parametrize("ctas", [1, 3, 40])
def test_gpu_any_grid_gives_the_same_bits(monkeypatch, ctas):
    """Tickets hand the tasks out: one CTA, a few, or fewer than the SMs do the same sums."""
    monkeypatch.setattr(WT, "ENABLED", True)
    G, R, Ka, N = V4
    o, wa, sa, wb, sb = operands(2, G, R, Ka, N, seed=11, dev="cuda")
    want = _pair(o, wa, sa, wb, sb, G)
    y = WT.wo_tail(o, wa, sa, wb, sb, G, WT.ENTRY, ctas=ctas)
    WT.check(o.device)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_tail_in_a_graph_with_pdl(monkeypatch):
    """Captured with PDL behind a kernel that writes o, replayed four times with o changing: the
    two launches' bits every replay (the counters put themselves back), no wait gave up."""
    monkeypatch.setattr(WT, "ENABLED", True)
    G, R, Ka, N = V4
    o, wa, sa, wb, sb = operands(1, G, R, Ka, N, seed=7, dev="cuda")
    old = common.set_pdl(True)
    try:
        src, xs = o.clone(), torch.empty_like(o)
        WT.wo_tail(o, wa, sa, wb, sb, G, WT.ENTRY)  # builds before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            xs.copy_(src * 1)  # a predecessor that writes the input
            y = WT.wo_tail(xs, wa, sa, wb, sb, G, WT.ENTRY)
        for r in range(4):
            src.copy_(o * (r + 1))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), _pair(src, wa, sa, wb, sb, G).view(torch.int16)), r
    finally:
        common.set_pdl(old)
    WT.check(o.device)
