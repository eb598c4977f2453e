"""cuda_module: nvcc builds and their cache (CPU, needs nvcc), the errors when the toolchain is
missing or the source is wrong, and launches on the GPU (eager and inside a CUDA graph)."""

import os
import subprocess

import pytest
import torch

from megastep.kernels import cuda_module as cm

SOURCE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

// every scalar kind of the signature; the shifts see the high bits of c and d
extern "C" __global__ void affine(float* y, const float* x, float a, int b, unsigned int c, long long d, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + (float)b + (float)(c >> 28) + (float)(d >> 32);
}

// add_one after griddepcontrol.wait: launched with PDL it may start while its predecessor drains
extern "C" __global__ void wait_add_one(float* x, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

// reverses x within one block through dynamic shared memory (more than the default 48 KiB)
extern "C" __global__ void reverse_smem(float* y, const float* x, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];
}
"""

needs_nvcc = pytest.mark.skipif(cm.find_nvcc() is None, reason="nvcc not installed")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private HOME, so the cubin cache goes under tmp_path, not the real ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "kernels.cu"
    p.write_text(SOURCE)
    return str(p)


def cache_files():
    d = cm.cache_dir()
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


@needs_nvcc
def test_build_cubin_and_cache(home, source, monkeypatch):
    assert cm.cache_dir().startswith(str(home))
    cubin = cm.build_cubin(source)
    assert cubin[:4] == b"\x7fELF"
    files = cache_files()
    assert len(files) == 1 and files[0].endswith(".cubin")  # no temporary file left behind

    real_run = subprocess.run

    def no_compile(cmd, *a, **k):
        assert "--cubin" not in cmd, "nvcc ran again for a cached cubin"
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(cm.subprocess, "run", no_compile)
    assert cm.build_cubin(source) == cubin
    # so does a module: it takes the cached cubin
    assert cm.CudaModule(source).cubin() == cubin

    # other flags are another cache entry
    monkeypatch.setattr(cm.subprocess, "run", real_run)
    assert cm.build_cubin(source, extra_flags=("-DUNUSED=1",))[:4] == b"\x7fELF"
    assert len(cache_files()) == 2


@needs_nvcc
def test_an_included_header_is_part_of_the_cache_key(home, tmp_path):
    """A change in a file the source includes with quotes rebuilds; an unchanged one does not."""
    (tmp_path / "scale.cuh").write_text("#pragma once\n#define SCALE 2.0f\n")
    src = tmp_path / "uses_header.cu"
    src.write_text('#include "scale.cuh"\nextern "C" __global__ void scale(float* x) { x[threadIdx.x] *= SCALE; }\n')
    first = cm.build_cubin(str(src))
    assert cm.build_cubin(str(src)) == first and len(cache_files()) == 1
    (tmp_path / "scale.cuh").write_text("#pragma once\n#define SCALE 3.0f\n")
    assert cm.build_cubin(str(src)) != first and len(cache_files()) == 2


@needs_nvcc
def test_build_error_shows_nvcc_stderr(home, tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void broken(float* x) { x[0] = ; }\n')
    with pytest.raises(cm.CudaUnavailable) as e:
        cm.build_cubin(str(bad))
    msg = str(e.value)
    assert "nvcc failed to build" in msg and "bad.cu" in msg
    assert "expected an expression" in msg  # nvcc's own diagnostic
    assert cache_files() == []  # neither a cubin nor a temporary file


def test_no_nvcc(home, source, monkeypatch):
    monkeypatch.setattr(cm, "find_nvcc", lambda: None)
    with pytest.raises(cm.CudaUnavailable, match="nvcc was not found"):
        cm.build_cubin(source)
    with pytest.raises(cm.CudaUnavailable, match="nvcc was not found"):
        cm.CudaModule(source).cubin()


def test_find_nvcc_cuda_home(tmp_path, monkeypatch):
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cm.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert cm.find_nvcc() == str(fake)


def test_lazy_and_signature_checked(tmp_path):
    # constructing a module and its kernels builds and loads nothing (the source need not exist yet)
    mod = cm.CudaModule(str(tmp_path / "missing.cu"))
    k = mod.kernel("add_one", "pi")
    assert k.signature == "pi"
    with pytest.raises(ValueError, match="unknown signature"):
        mod.kernel("add_one", "px")
    with pytest.raises(ValueError, match="arch"):
        cm.build_cubin(str(tmp_path / "missing.cu"), arch="90")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launch_with_pdl_eager_and_graph(home, source):
    """pdl=True (cuLaunchKernelEx with programmatic stream serialization): the kernel runs after
    its predecessor's writes, eagerly and in a captured graph, chained several times."""
    major, minor = torch.cuda.get_device_capability()
    mod = cm.CudaModule(source, arch=f"sm_{major}{minor}")
    add_one, wait_add_one = mod.kernel("add_one", "pi"), mod.kernel("wait_add_one", "pi")
    n = 1 << 20
    x = torch.zeros(n, dtype=torch.float32, device="cuda")
    grid = (-(-n // 256), 1, 1)

    def chain():
        for _ in range(4):
            add_one.launch(grid, (256, 1, 1), 0, None, x, n)
            wait_add_one.launch(grid, (256, 1, 1), 0, None, x, n, pdl=True)

    chain()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 8.0))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 24.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launch_eager_and_graph(home, source):
    major, minor = torch.cuda.get_device_capability()
    mod = cm.CudaModule(source, arch=f"sm_{major}{minor}")
    add_one = mod.kernel("add_one", "pi")
    n = 1000
    x = torch.arange(n, dtype=torch.float32, device="cuda")
    ref = x.clone()
    grid = (-(-n // 256), 1, 1)
    add_one.launch(grid, (256, 1, 1), 0, None, x, n)
    torch.cuda.synchronize()
    assert torch.equal(x, ref + 1)

    # captured on the capture stream (the current stream inside torch.cuda.graph), replayed twice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        add_one.launch(grid, (256, 1, 1), 0, None, x, n)
    torch.cuda.synchronize()
    assert torch.equal(x, ref + 1)  # capture does not run the kernel
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, ref + 3)

    attrs = add_one.attributes()
    assert attrs["num_regs"] > 0 and attrs["local_size_bytes"] == 0 and attrs["max_threads_per_block"] >= 256

    # every scalar kind, an explicit stream, and a raw pointer
    affine = mod.kernel("affine", "ppfiIqq")
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    affine.launch(grid, (256, 1, 1), 0, s, y, x.data_ptr(), 0.5, -3, 0xFFFFFFFF, 5 << 32, n)
    s.synchronize()
    assert torch.equal(y, 0.5 * x + (-3 + 15 + 5))  # every term exact in fp32

    # dynamic shared memory beyond 48 KiB (the launch opts in through the function attribute)
    rev = mod.kernel("reverse_smem", "ppi")
    m = 16384  # 64 KiB of fp32
    src = torch.randn(m, device="cuda")
    dst = torch.empty_like(src)
    rev.launch((1, 1, 1), (512, 1, 1), m * 4, None, dst, src, m)
    torch.cuda.synchronize()
    assert torch.equal(dst, src.flip(0))

    with pytest.raises(TypeError):
        add_one.launch(grid, (256, 1, 1), 0, None, x)
