"""The CUDA C++ experiments under benchmarks/kernels, on the CPU: their sources still build with
nvcc into the entry points their wrappers name, with as many parameters as the wrappers'
signatures pass; the GEMV's shape rules keep within its kernel's limits; the timing probes of
launch_floor.py still find the lines they edit. Their numerics are checked on the GPU by their
scripts (gemv_variants.py: against the torch ref, run to run, a row alone against the batch).
The probes of route_probe.py (edited copies of the runtime's kernels/route_cuda.cu) still find their
lines and build. (The runtime's CUDA kernels themselves are checked beside their tests:
kernels/moe_lut.cu in tests/kernels/test_moe.py, kernels/route_cuda.cu in tests/kernels/test_route_cuda.py.)"""

import os
import sys

import pytest

from megastep.kernels import cuda_module as cm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks", "kernels"))

import gemv_fp8_cuda as GV  # noqa: E402
import launch_floor as LF  # noqa: E402

needs_nvcc = pytest.mark.skipif(cm.find_nvcc() is None, reason="nvcc not installed")


def _params(source: str, name: str) -> int:
    """The number of parameters of `extern "C"` kernel `name` in a .cu file's text."""
    head = source[source.index(name + "("):]
    return head[:head.index(")")].count(",") + 1


@needs_nvcc
def test_gemv_source_builds_with_every_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cubin = cm.build_cubin(GV._SOURCE)
    assert cubin[:4] == b"\x7fELF"
    for nt in (1, 2, 4, 8):
        for nb in (1, 2, 4, 8):
            assert f"gemv_fp8_nt{nt}_nb{nb}".encode() in cubin, (nt, nb)


@pytest.mark.parametrize("N,K,gated", [(1536, 4096, False), (40960, 1024, False), (4096, 8192, False),
                                       (2048, 4096, True), (4096, 2048, False), (128, 4096, False)])
def test_configs_keep_within_the_kernel(N, K, gated):
    nbs = set()
    for M in (1, 4, 16, 64):
        c = GV.pick_config(M, N, K, gated)
        nbs.add(c.nb)
        assert K % (128 * c.nb) == 0 and K // (128 * c.nb) <= GV.MAX_SPLIT
        assert 8 * c.nt >= min(M, 8) and c.r * (2 if gated else 1) <= 8
        assert GV._smem(c.nt, c.nb, c.r * (2 if gated else 1)) <= GV.SMEM_LIMIT
    assert len(nbs) == 1  # the K split, hence every row's order of sums, depends on the shape only


def test_launch_floor_probes_find_their_lines():
    texts = [open(p).read() for p in LF.PROBE_FILES]
    for name, edits in LF.PROBES:
        for old, _ in edits:
            assert sum(old in t for t in texts) == 1, (name, old)


def test_signatures_match_the_kernels():
    gemv_src = open(GV._SOURCE).read()
    assert _params(gemv_src, "gemv_fp8_nt##NT##_nb##NB") == len(GV._SIGNATURE)


@needs_nvcc
def test_route_probes_edit_once_and_build(tmp_path, monkeypatch):
    """route_probe.py's early exits and variants each edit route_cuda.cu exactly once (checked
    inside probe_kernels) and build for V4-Flash's expert count."""
    import route_probe as RP

    from megastep.kernels import route_cuda

    monkeypatch.setenv("HOME", str(tmp_path))
    kernels = RP.probe_kernels(str(tmp_path))
    assert sorted(kernels) == sorted(name for name, _, _ in RP.PROBES)
    for name, (_, exact) in kernels.items():
        assert exact == name.startswith(("shuffle", "fns"))  # the variants are checked against production
        path = str(tmp_path / name / "route_cuda.cu")
        assert cm.build_cubin(path, extra_flags=route_cuda.build_flags(RP.E))[:4] == b"\x7fELF"
