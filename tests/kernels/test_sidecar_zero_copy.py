"""sidecar_zero_copy (recipe B's CPU job posted and collected by two one-CTA kernels through page-locked
memory in place): it builds without spills and the Python side passes what the .cu takes (CPU, needs
nvcc); the torch refs do what the sidecar's copies did (CPU); on a GPU, with the CPU thread polling,
the kernels give the refs' bits, post nothing when no slot has a CPU expert, and replay in a graph."""

import os
import sys
import time

import pytest
import torch

from megastep.cpu import experts as ce
from megastep.kernels import sidecar_zero_copy as Z
from megastep.kernels.cuda_module import find_nvcc
from megastep.runtime.sidecar import add_pairs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cuda_checks import assert_builds_without_spills, assert_signature_matches  # noqa: E402
from test_cpu_experts import _stack, _x  # noqa: E402

needs_kernel = pytest.mark.skipif(not ce.available_isas(), reason="compiled CPU kernel unavailable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or find_nvcc() is None, reason="needs a GPU and nvcc")

D, I, E, K = 512, 256, 8, 3
CPU_EXPERTS = [1, 4, 6]  # of the layer's E, computed on the CPU


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_builds_for_sm90_without_spills():
    assert_builds_without_spills(Z.SOURCE, ("sidecar_post", "sidecar_collect"))


def test_signatures_match_the_source():
    for k in (Z._POST, Z._COLLECT):
        assert_signature_matches(Z.SOURCE, k)


def _layer(g, device="cpu"):
    st = _stack(D, I, len(CPU_EXPERTS), g)
    local = torch.full((E,), -1, dtype=torch.int32)
    local[CPU_EXPERTS] = torch.arange(len(CPU_EXPERTS), dtype=torch.int32)
    return st, local.to(device)


def _job(M, device="cpu", pin=False):
    host = {"pin_memory": pin}
    dev = {"dtype": torch.int32, "device": device}
    return Z.ZeroCopyJob(torch.full((M, D), 3.0, dtype=torch.bfloat16, **host), torch.full((M, K), 9, dtype=torch.int32, **host),
                         torch.full((M, K), 5.0, **host), torch.zeros(M, K, D, dtype=torch.bfloat16, **host),
                         torch.zeros(1, dtype=torch.int32, **host), torch.empty(M, K, **dev), torch.zeros(1, **dev),
                         torch.zeros(1, **dev), torch.zeros(1, **dev))


def _pairs(M, dids, g, device="cpu"):
    """The GPU experts kernel's per-slot outputs: values at its slots, zero at the CPU's."""
    p = torch.randn(M, K, D, generator=g).bfloat16()
    p[dids.cpu() >= 0] = 0
    return p.to(device)


@needs_kernel
def test_refs_do_what_the_copies_did():
    """post_ref, the CPU job, collect_ref: the CPU slots' outputs added to the GPU's pairs exactly as
    the copying sidecar's `add_pairs` does; a call whose rows chose no CPU expert posts nothing (the
    host buffers and the flag untouched, the job not run); every call counted; the flag back at 0."""
    g = torch.Generator().manual_seed(3)
    st, local = _layer(g)
    M = 2
    job = _job(M)
    cpu_job = ce.sidecar_job(job.x, job.ids, job.rw, st["w13"], st["w13_scale"], st["w2"], st["w2_scale"], job.y,
                             num_threads=2)
    x, w = _x(M, D, g), torch.rand(M, K, generator=g) + 0.05
    for idx, posted in (([[1, 0, 6], [2, 4, 1]], True), ([[0, 2, 3], [5, 7, 0]], False), ([[4, 5, 7], [3, 2, 0]], True)):
        idx = torch.tensor(idx, dtype=torch.int32)
        before = (job.x.clone(), job.ids.clone(), job.rw.clone())
        Z.post_ref(x, idx, w, local, job)
        assert torch.equal(job.dids, local[idx.long()]) and int(job.posted[0]) == posted
        if posted:
            assert int(job.flag[0]) == 1 and torch.equal(job.x, x) and torch.equal(job.ids, job.dids)
            assert torch.equal(job.rw, w)
            ce.run_sidecar_job(cpu_job)  # what the polling thread does, then it stores 2
            job.flag.fill_(2)
        else:
            assert int(job.flag[0]) == 0 and all(torch.equal(a, b) for a, b in zip(before, (job.x, job.ids, job.rw)))
        pairs = _pairs(M, job.dids, g)
        want = add_pairs(pairs, job.y * (job.dids >= 0)[..., None] if posted else torch.zeros_like(pairs))
        assert torch.equal(Z.collect_ref(pairs.clone(), job), want)
        assert int(job.flag[0]) == 0
    assert int(job.calls[0]) == 3


def test_collect_ref_refuses_a_job_the_cpu_did_not_run():
    g = torch.Generator().manual_seed(4)
    _, local = _layer(g)
    job = _job(1)
    Z.post_ref(_x(1, D, g), torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.ones(1, K), local, job)
    with pytest.raises(RuntimeError, match="has not run"):
        Z.collect_ref(torch.zeros(1, K, D, dtype=torch.bfloat16), job)


def test_zero_copy_is_for_cuda_devices_only(monkeypatch):
    """On a CPU device the sidecar runs each job at `start`, whatever ZERO_COPY says; `check` (the
    engine's after every step, the bench's after every batch) has nothing to read then, and raises
    once a zero-copy wait has given up."""
    from megastep.runtime import sidecar

    monkeypatch.setattr(sidecar, "ZERO_COPY", True)
    car = sidecar.CpuSidecar(torch.device("cpu"), 10.0)
    assert not car.zero_copy and car._poller is None
    car.check()
    car._err = torch.ones(1, dtype=torch.int32)  # what sidecar_collect writes when it gives up
    with pytest.raises(RuntimeError, match="did not answer"):
        car.check()


# ---- on a GPU -------------------------------------------------------------------------------------


def _wait(flag, value):
    t0 = time.monotonic()
    while int(flag[0]) != value:
        assert time.monotonic() - t0 < 10, f"flag stuck at {int(flag[0])}"
        time.sleep(0.0005)


@pytest.mark.gpu
@needs_cuda
@needs_kernel
@pytest.mark.parametrize("M", [1, 6])
def test_gpu_kernels_give_the_refs_bits(M):
    """post -> the polling CPU thread -> collect, on page-locked memory read and written in place:
    the pairs equal the refs' (the copying sidecar's) bit for bit; a call whose rows chose no CPU
    expert posts nothing (flag 0, the CPU job never runs, the pairs unchanged); err stays 0; and the
    same calls replayed from a CUDA graph give the same bits."""
    from megastep.runtime.sidecar import _driver

    g = torch.Generator().manual_seed(M)
    st, local = _layer(g, "cuda")
    job, ref = _job(M, "cuda", pin=True).map_host(_driver()), _job(M)
    stacked = (st["w13"], st["w13_scale"], st["w2"], st["w2_scale"])
    cpu_job = ce.sidecar_job(job.x, job.ids, job.rw, *stacked, job.y, num_threads=2)
    ref_job = ce.sidecar_job(ref.x, ref.ids, ref.rw, *stacked, ref.y, num_threads=1)
    poller = ce.Poller()
    poller.add(cpu_job, job.flag)
    try:
        x = _x(M, D, g).cuda()
        w = (torch.rand(M, K, generator=g) + 0.05).cuda()
        calls = [torch.tensor([[1, 0, 6]] * M, dtype=torch.int32), torch.tensor([[0, 2, 3]] * M, dtype=torch.int32)]
        calls.append(torch.randint(0, E, (M, K), generator=g, dtype=torch.int32))
        for idx in calls:
            idx = idx.cuda()
            Z.post_ref(x.cpu(), idx.cpu(), w.cpu(), local.cpu(), ref)
            if int(ref.posted[0]):
                ce.run_sidecar_job(ref_job)
                ref.flag.fill_(2)
            pairs = _pairs(M, ref.dids, g, "cuda")
            want = Z.collect_ref(pairs.cpu().clone(), ref)
            runs, last = cpu_job.runs, pairs.clone()
            Z.post(x, idx, w, local, job)
            got = Z.collect(pairs, job)
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), want) and int(job.err[0]) == 0
            assert int(job.flag[0]) == 0 and cpu_job.runs == runs + int(ref.posted[0])
        # the same in a graph: the last call's inputs, replayed
        pairs, base = last.clone(), last
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            Z.post(x, idx, w, local, job)
            Z.collect(pairs, job)
        for _ in range(3):
            pairs.copy_(base)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(pairs.cpu(), want) and int(job.err[0]) == 0 and int(job.flag[0]) == 0
    finally:
        poller.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_collect_gives_up_without_a_cpu_thread():
    """No polling thread: collect waits ~2 s, then sets err and leaves the pairs as they were (the
    device does not hang)."""
    from megastep.runtime.sidecar import _driver

    g = torch.Generator().manual_seed(9)
    _, local = _layer(g, "cuda")
    job = _job(1, "cuda", pin=True).map_host(_driver())
    idx = torch.tensor([[1, 0, 6]], dtype=torch.int32, device="cuda")
    Z.post(_x(1, D, g).cuda(), idx, torch.ones(1, K, device="cuda"), local, job)
    pairs = torch.randn(1, K, D, device="cuda").bfloat16()
    base = pairs.clone()
    t0 = time.monotonic()
    Z.collect(pairs, job)
    torch.cuda.synchronize()
    assert 1.5 < time.monotonic() - t0 < 30
    assert int(job.err[0]) == 1 and torch.equal(pairs, base) and int(job.flag[0]) == 1
