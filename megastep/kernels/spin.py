"""A wait of a given length on a stream: one program that spins on the GPU's global timer, for
timing probes only (nothing in a served step launches it).

Used by `runtime.trace.DELAY_NS` (a delay at a named stage's entry, to find which stages the step
waits for) and by the benchmarks that stand a latency-bound stage in as a wait
(benchmarks/kernels/chain_probe.py, l2_prefetch.py).

Shapes and dtypes: `out` is any int64 CUDA tensor of at least one element; the kernel writes the
nanoseconds it spun into out[0] (so the launch has an effect the compiler keeps). Its torch twin
`spin_ref` busy-waits on the host (the interpreter runs no PTX).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


@triton.jit
def wait_ns(ns):
    """Spin on the global timer until `ns` nanoseconds have passed; returns the nanoseconds spun."""
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ns], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [ns], dtype=tl.int64, is_pure=False,
                                      pack=1)
    return t - t0


@triton.jit
def _spin_kernel(out_ptr, ns):
    tl.store(out_ptr, wait_ns(ns))


def spin(out: torch.Tensor, ns: int) -> None:
    """Launch a wait of `ns` nanoseconds on the current stream of out's device (one program of one
    warp); on a CPU tensor, spin_ref."""
    if ns < 0:
        raise ValueError(f"a wait is at least 0 ns, got {ns}")
    if out.device.type != "cuda":
        spin_ref(out, ns)
        return
    _spin_kernel[(1,)](out, int(ns), num_warps=1)


def spin_ref(out: torch.Tensor, ns: int) -> None:
    t0 = time.perf_counter_ns()
    while time.perf_counter_ns() - t0 < ns:
        pass
    out.view(-1)[0] = time.perf_counter_ns() - t0
