"""linear_fp8_staged (the CUDA twin of linear_fp8's plain "f16" launches of few rows that stages its
weights before its input): it builds without spills and the Python side passes what the .cu takes
(CPU, needs nvcc); which launches it takes; on a GPU, the Triton loop's bits at the V4-Flash plain
shapes, rows 1-16, bf16 and fp32 output, with and without PDL and the later waves' L2 prefetch,
alone and in a CUDA graph."""

import os
import sys
import types

import pytest
import torch

from megastep.kernels import common
from megastep.kernels import linear_fp8 as LIN
from megastep.kernels import linear_fp8_staged as ST
from megastep.kernels.cuda_module import find_nvcc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_checks import assert_builds_without_spills, assert_signature_matches  # noqa: E402
from test_linear_fp8 import check, make  # noqa: E402

KERNELS = tuple(k.name for k in ST._KERNELS.values())
# (N, K, groups, quantize_act): wo_a (8 groups, bf16 x), wo_b, the x group, the shared w2, the qr group
PLAIN = [(8192, 4096, 8, False), (4096, 8192, 1, True), (1536, 4096, 1, True), (4096, 2048, 1, True),
         (40960, 1024, 1, True)]


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_builds_for_sm90_without_spills():
    assert_builds_without_spills(ST.SOURCE, KERNELS)


def test_signatures_match_the_source():
    """The kernels are instantiated by one macro (their names pasted from NT, NB and W), so its
    parameter list is what each launch must match."""
    assert {k.signature for k in ST._KERNELS.values()} == {ST._SIGNATURE}
    entry = types.SimpleNamespace(name="linear_fp8_staged_nt##NT##_nb##NB##_w##W", signature=ST._SIGNATURE)
    assert_signature_matches(ST.SOURCE, entry)


def test_shared_memory_fits_a_hopper_cta():
    """Every instantiation's CTA (its warps' weights, x's codes and scales) fits Hopper's 227 KB."""
    for nt, nb, w in ST._KERNELS:
        assert ST.shared_bytes(nt, nb, w) <= 227 << 10, (nt, nb, w)


def test_ref_is_linear_fp8s():
    x, w, s = make(3, 256, 2 * 512, seed=1, dev="cpu")
    w, s = w[:, :512].contiguous(), s[:, :4].contiguous()
    assert torch.equal(ST.linear_fp8_staged_ref(x, w, s, False, 2), LIN.linear_fp8_ref(x, w, s, quantize_act=False,
                                                                                        groups=2))


def test_plan_takes_only_listed_launches_of_few_rows(monkeypatch):
    """Off unless the shape is listed; then only CUDA bf16 launches of 1-16 rows in the "f16" mode,
    without a residual, whose split the kernel can take."""
    x = torch.zeros(1, 8 * 4096, dtype=torch.bfloat16)
    w = torch.zeros(8192, 4096, dtype=torch.float8_e4m3fn)
    assert ST.plan(x, w, 8, 1024, "f16", None) is None  # nothing listed
    monkeypatch.setattr(ST, "SHAPES", frozenset({(8192, 4096, 8)}))
    assert ST.plan(x, w, 8, 1024, "f16", None) is None  # a CPU tensor
    if not torch.cuda.is_available() or find_nvcc() is None:
        return
    xc, w = x.cuda(), w.cuda()
    assert ST.plan(xc, w, 8, 1024, "f16", None) == (1, 8, ST.WARPS, 4)
    assert ST.plan(xc[:0], w, 8, 1024, "f16", None) is None
    rows = [torch.zeros(m, 8 * 4096, dtype=torch.bfloat16, device="cuda") for m in (9, 17)]
    assert ST.plan(rows[0], w, 8, 1024, "f16", None) == (2, 8, ST.WARPS, 4)
    assert ST.plan(rows[1], w, 8, 1024, "f16", None) is None
    assert ST.plan(xc, w, 8, 1024, "dot16", None) is None
    assert ST.plan(xc, w, 8, 1024, "f16", torch.zeros(1, 8192, device="cuda")) is None
    assert ST.plan(xc.float(), w, 8, 1024, "f16", None) is None
    off = torch.zeros(1, 8 * 4096 + 8, dtype=torch.bfloat16, device="cuda")[:, 1:-7]  # rows 2 bytes off 16
    assert ST.plan(off, w, 8, 1024, "f16", None) is None


def _both(monkeypatch, x, w, s, quantize_act, groups, out_dtype):
    """(Triton's output, the staged kernel's) for the same launch."""
    monkeypatch.setattr(ST, "SHAPES", frozenset())
    ref = LIN.linear_fp8(x, w, s, quantize_act=quantize_act, groups=groups, out_dtype=out_dtype)
    monkeypatch.setattr(ST, "SHAPES", frozenset({(w.shape[0], w.shape[1], groups)}))
    assert ST.plan(x, w, groups, LIN._k_per_split(w.shape[1], LIN.pick_config(x.shape[0], *w.shape)), "f16",
                   None) is not None
    return ref, LIN.linear_fp8(x, w, s, quantize_act=quantize_act, groups=groups, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 9, 16])
@pytest.mark.parametrize("N,K,G,quant", PLAIN)
def test_gpu_staged_gives_the_triton_loops_bits(monkeypatch, N, K, G, quant, M, out_dtype, pdl, warps):
    monkeypatch.setattr(ST, "WARPS", warps)
    x, w, s = make(M, N, G * K, seed=N + K + M, dev="cuda")
    if G > 1:  # wo_a: each group's rows over its own K columns of x
        from megastep.checkpoint import formats as F
        w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    old = common.set_pdl(pdl)
    try:
        ref, y = _both(monkeypatch, x, w, s, quant, G, out_dtype)
        y2 = LIN.linear_fp8(x, w, s, quantize_act=quant, groups=G, out_dtype=out_dtype)
    finally:
        common.set_pdl(old)
    torch.cuda.synchronize()
    assert torch.equal(y, y2)  # the same bits run to run
    assert torch.equal(y.view(torch.int16) if out_dtype == torch.bfloat16 else y.view(torch.int32),
                       ref.view(torch.int16) if out_dtype == torch.bfloat16 else ref.view(torch.int32))
    check(y, ST.linear_fp8_staged_ref(x, w, s, quant, G, out_dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N,K,G,quant", PLAIN[:2])
def test_gpu_prefetching_later_waves_changes_no_bits(monkeypatch, N, K, G, quant, M, pdl, warps):
    """The first wave's CTAs fetching the later waves' weights into L2 (PREFETCH_LATER_WAVES) at
    wo_a's and wo_b's shapes (2-4 waves of CTAs): Triton's bits still."""
    monkeypatch.setattr(ST, "WARPS", warps)
    monkeypatch.setattr(ST, "PREFETCH_LATER_WAVES", True)
    x, w, s = make(M, N, G * K, seed=N + K + M + 1, dev="cuda")
    if G > 1:
        from megastep.checkpoint import formats as F
        w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    old = common.set_pdl(pdl)
    try:
        ref, y = _both(monkeypatch, x, w, s, quant, G, torch.bfloat16)
    finally:
        common.set_pdl(old)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_staged_in_a_graph_with_pdl(monkeypatch, prefetch):
    """wo_a's launch captured with PDL behind another kernel, replayed: Triton's bits every replay
    (the split-K counters reset themselves)."""
    G, R, K = 8, 1024, 4096
    x, w, s = make(1, G * R, G * K, seed=5, dev="cuda")
    from megastep.checkpoint import formats as F
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    ref = LIN.linear_fp8(x, w, s, quantize_act=False, groups=G)
    monkeypatch.setattr(ST, "SHAPES", frozenset({(G * R, K, G)}))
    monkeypatch.setattr(ST, "PREFETCH_LATER_WAVES", prefetch)
    old = common.set_pdl(True)
    try:
        xs = torch.empty_like(x)
        LIN.linear_fp8(x, w, s, quantize_act=False, groups=G)  # builds before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            xs.copy_(x * 1)  # a predecessor that writes the input
            y = LIN.linear_fp8(xs, w, s, quantize_act=False, groups=G)
    finally:
        common.set_pdl(old)
    for _ in range(3):
        xs.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
