"""Bandwidth probes, measured in the run that uses them: the device's streaming read, a kernel's
reads of page-locked host memory (the zero-copy path of cold experts), and the host cores' reads
(the ceiling of the CPU sidecar). The hybrid cold path splits cold experts between the last two
in proportion to them (`hybrid_cpu_share`)."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


def _best_seconds(fn, iters: int, cuda: bool) -> float:
    """The fastest of `iters` runs of fn (after one warm-up): CUDA events on a GPU, else wall time."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def stream_read_bandwidth(device: torch.device, gib: float = 4.0, iters: int = 10) -> float:
    """Streaming read bandwidth in GB/s: a full sum over a buffer much larger than L2."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    return n * 4 / _best_seconds(x.sum, iters, cuda=True) / 1e9


@triton.jit
def _host_read_kernel(addr, out_ptr, n_words, WORDS: tl.constexpr):
    """Sum int32 words of a buffer given by its (device-visible) address: a pure read stream."""
    base = addr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([WORDS], dtype=tl.int32)
    for w0 in range(tl.program_id(0) * WORDS, n_words, tl.num_programs(0) * WORDS):
        offs = w0 + tl.arange(0, WORDS)
        acc += tl.load(base + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def host_read_bandwidth(device: torch.device, gib: float = 1.0, iters: int = 5, programs: int = 64) -> float:
    """GB/s of a kernel reading page-locked host memory through its device-visible address (the
    zero-copy path by which a MoE kernel reads cold experts)."""
    n = int(gib * 2**30) // 4
    buf = torch.ones(n, dtype=torch.int32, pin_memory=True)
    out = torch.empty(programs, dtype=torch.int32, device=device)
    secs = _best_seconds(lambda: _host_read_kernel[(programs,)](buf.data_ptr(), out, n, WORDS=2048), iters, cuda=True)
    if int(out.sum()) != n:  # every word read (and summed) exactly once
        raise RuntimeError("host read kernel checksum mismatch")
    return n * 4 / secs / 1e9


def cpu_read_bandwidth(gib: float = 2.0, iters: int = 3) -> float:
    """GB/s of the host's cores reading host memory (torch's CPU sum with its full thread pool):
    the ceiling of the CPU sidecar's expert reads."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, dtype=torch.float32)
    return n * 4 / _best_seconds(x.sum, iters, cuda=False) / 1e9


def hybrid_cpu_share(device: torch.device, cpu_GBps: float | None = None, host_GBps: float | None = None) -> float:
    """The CPU's share of the cold bytes for the hybrid path: its read bandwidth over the sum of
    the two paths' (host cores' reads, the device's reads of page-locked memory), each measured
    now unless given. Without a GPU both paths are the host's cores: half each."""
    if device.type != "cuda":
        return 0.5
    cpu = cpu_GBps or cpu_read_bandwidth()
    gpu = host_GBps or host_read_bandwidth(device)
    return cpu / (cpu + gpu)
