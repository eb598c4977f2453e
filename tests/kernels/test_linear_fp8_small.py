"""linear_fp8_small (the CUDA C++ loop for a few rows) against linear_fp8's Triton loop: the same
bits at every V4-Flash shape, row count 1..16, epilogue and activation path (GPU); the launch rules
and the build (CPU)."""

import pytest
import torch

from megastep.checkpoint import formats as F
from megastep.kernels import linear_fp8 as L
from megastep.kernels import linear_fp8_small as S
from megastep.kernels.cuda_module import find_nvcc

from test_linear_fp8 import LIMIT, V4_SHAPES, check, codes_of, make, make_w13, same_bits

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_launch_rules():
    """Only a CUDA device; at most ROWS (and 16) rows; "f16" with whole splits of 1, 2, 4 or 8 blocks;
    the CTA's tiles never cross a group of wo_a."""
    x, w = torch.zeros(1, 1024, dtype=torch.bfloat16), torch.zeros(64, 1024, dtype=torch.float8_e4m3fn)
    assert not S.supported(x, w, 1, 64, 1024, 1024, "f16", rows=16)  # CPU
    for M in (1, 8, 9, 16):
        for N, K, kps, gated, gn in [(32768, 1024, 1024, False, 32768), (8192, 4096, 1024, False, 1024),
                                     (2048, 4096, 512, True, 2048), (1536, 4096, 512, False, 1536)]:
            nt, r = S._ctas(M, N, K, kps, gated, gn)
            assert nt == (1 if M <= 8 else 2) and gn % (16 * r) == 0 and r * (2 if gated else 1) <= 8


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_cuda_source_builds_with_every_entry():
    cubin = S._MODULE.cubin()
    for load in S.LOADS:
        for nt in (1, 2):
            for nb in (1, 2, 4, 8):
                assert f"linear_fp8_small_{load}_nt{nt}_nb{nb}".encode() in cubin, (load, nt, nb)


def test_signature_matches_the_kernel():
    src = open(S._SOURCE).read()
    head = src[src.index("linear_fp8_small_##NAME##_nt##NT##_nb##NB("):]
    assert head[:head.index(")")].count(",") + 1 == len(S._SIGNATURE)


# ---- on the GPU: bit for bit against the Triton loop -----------------------------------------------
@pytest.fixture(params=S.LOADS)
def load(request, monkeypatch):
    monkeypatch.setattr(S, "LOAD", request.param)
    return request.param


def both(monkeypatch, fn):
    """fn() with the Triton loop, then with the CUDA loop (ROWS 16): both results."""
    monkeypatch.setattr(S, "ROWS", 0)
    a = fn()
    monkeypatch.setattr(S, "ROWS", 16)
    b = fn()
    torch.cuda.synchronize()
    return a, b


@pytest.mark.parametrize("N,K", V4_SHAPES + [(1536, 4096), (40960, 1024)])
@pytest.mark.parametrize("M", [1, 2, 9, 16])
@pytest.mark.parametrize("codes", [False, True])
@pytest.mark.gpu
@needs_gpu
def test_gpu_same_bits_as_triton(M, N, K, codes, load, monkeypatch):
    x, w, s = make(M, N, K, seed=M + N + K, dev="cuda")
    c = codes_of(x) if codes else None
    assert S.supported(x, w, M, N, K, *_split(M, N, K), rows=16)
    for od in (torch.float32, torch.bfloat16):  # fp32: every bit of the sums
        a, b = both(monkeypatch, lambda: L.linear_fp8(x, w, s, out_dtype=od, x_codes=c))
        assert same_bits(a, b), od
    check(b, L.linear_fp8_ref(x, w, s))


def _split(M, N, K):
    cfg = L.pick_config(M, N, K)
    kb = K // 128
    kps = -(-kb // min(cfg.split_k, kb)) * 128
    return kps, cfg.mode


@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.gpu
@needs_gpu
def test_gpu_wo_a_same_bits_as_triton(M, load, monkeypatch):
    """wo_a: 8 groups of 1024 rows over their 4096 columns of a bf16 x, no activation quantization."""
    G, R, K = 8, 1024, 4096
    x, w, s = make(M, G * R, G * K, seed=M, dev="cuda")
    w, s = F.quantize_fp8_weight(F.dequantize_fp8_weight(w, s, 128)[:, :K], 128)
    a, b = both(monkeypatch, lambda: L.linear_fp8(x, w, s, quantize_act=False, groups=G))
    assert same_bits(a, b)
    check(b, L.linear_fp8_ref(x, w, s, quantize_act=False, groups=G))


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("od", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.gpu
@needs_gpu
def test_gpu_epilogues_same_bits_as_triton(M, od, load, monkeypatch):
    """The shared expert: w1/w3 gated with the clamp, w2 with an fp32 and a bf16 residual; fp32 x."""
    x, w13, s13 = make_w13(M, 2048, 4096, seed=M, dev="cuda")
    a, b = both(monkeypatch, lambda: L.linear_fp8_swiglu(x, w13, s13, LIMIT, out_dtype=od))
    assert same_bits(a, b)
    _, w2, s2 = make(M, 4096, 2048, seed=M + 1, dev="cuda")
    for res in (torch.randn(M, 4096, device="cuda"), torch.randn(M, 4096, device="cuda").to(torch.bfloat16)):
        a, b = both(monkeypatch, lambda: L.linear_fp8(x[:, :2048].contiguous(), w2, s2, out_dtype=od, residual=res))
        assert same_bits(a, b)
    xf = x.float()
    a, b = both(monkeypatch, lambda: L.linear_fp8(xf, w13, s13, out_dtype=od))
    assert same_bits(a, b)


@pytest.mark.gpu
@needs_gpu
def test_gpu_a_row_alone_equals_the_row_in_a_batch(load, monkeypatch):
    """A row through the CUDA loop alone (1 row) and through Triton in a batch of 64: the same bits;
    and the CUDA loop's bits do not depend on the rows beside it (1, 3, 16 rows)."""
    monkeypatch.setattr(S, "ROWS", 16)
    for N, K in [(4096, 8192), (32768, 1024)]:
        x, w, s = make(64, N, K, seed=N, dev="cuda")
        full = L.linear_fp8(x, w, s)  # Triton: 64 rows
        for m in (1, 3, 16):
            part = L.linear_fp8(x[:m].contiguous(), w, s)
            assert same_bits(part, full[:m]), (N, K, m)
