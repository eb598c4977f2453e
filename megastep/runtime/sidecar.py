"""Recipe B of issue 4: cold routed experts computed on the CPU while the GPU runs the layer.

Per MoE call with CPU experts, in stream order (all of it capturable in a CUDA graph):

    main stream:  ids -> cold-local ids (device map) ... [hot experts kernel] ............ wait -> combine
    side stream:           fork -> x, ids, weights to page-locked staging -> host function -> y to device -> join

The host function is `ms_sidecar_run` of the compiled CPU kernel (megastep/cpu), launched with the
driver's cuLaunchHostFunc: a graph records it as a host node, and it runs on a driver thread
without Python (no GIL, so a host thread blocked in a CUDA call cannot deadlock it). It writes the
per-slot outputs of the slots routed to this layer's CPU experts and zero elsewhere; the GPU's
experts kernel writes the other slots (its table lacks the CPU experts) and zero at these, so the
two [M, k, D] buffers add as integers with one non-zero addend per element (the combine of
runtime/distributed.py), and the slot-order sum follows (kernels.moe.sum_pairs). The GPU waits for
the CPU only at the combine: the hot experts kernel runs meanwhile.

On a CPU device (tests, the reference machine) the same job runs synchronously.

With POLL the host function is replaced by flags (`cpu.experts.Poller`): after the staging copies
the side stream writes 1 into the job's page-locked flag word (cuStreamWriteValue32), a CPU thread
that scans the flags runs the job and stores 2, and the side stream waits for 2
(cuStreamWaitValue32) before copying y back, then writes 0. No host node: the GPU does not hand
control to a driver thread in every layer, and a layer whose rows are routed to none of its CPU
experts costs the CPU a zeroed y only, well before the GPU joins. The default since the
twenty-second measurement (docs/PERFORMANCE.md; all 43 layers, 125 GB in HBM, skewed routing, one
H200): recipe B 10.55 ms at 1 row against 11.79 with host functions, 28.44 against 30.19 for a
6-row block; hybrid 10.06 against 11.32, and 27.31 against 26.70 for 6 rows. A driver without
the stream memory operations gets the host functions, with a warning.

With ZERO_COPY (off until measured) the step's own stream posts and collects the job with two
one-CTA kernels (`kernels/sidecar_zero_copy.py`) that read and write the page-locked buffers in
place: no side stream, no copies, no stream memory operations, and a layer whose rows chose none
of its CPU experts posts nothing (the CPU thread does nothing, the GPU waits for nothing).

Staging buffers and jobs are made per (layer, rows) on first use and kept: a captured graph
points at them. The CPU experts' weights stay where the caller put them (host memory); the job
holds their addresses.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import torch

from megastep.cpu import experts as cpu_experts
from megastep.kernels import sidecar_zero_copy as _zc
from megastep.runtime.distributed import bit_words

POLL = True  # the flags instead of a host function (module doc)
ZERO_COPY = False  # post and collect on the step's stream, no copies (module doc); takes precedence over POLL
# The CPU team's threads (the polling thread among them) when the sidecar is not given a number; None:
# torch's intra-op count, every core of the host. Measured on an H100 host (16 vCPUs; docs/PERFORMANCE.md,
# "2026-12-05 from 12:51 UTC"): alone, one-expert calls took 382 us on 16 threads but 28 ms beside one
# spinning process (14 threads: 378 us); in the 16-layer B step 14 threads were ~5 % faster at one row
# than 16 and had the worst 6-row p99, 8 the best tails. No setting won everywhere, so the default stays.
THREADS: int | None = None

_CUDA_SUCCESS = 0
_WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_VALUE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: ordered after the stream's earlier writes


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    lib.cuMemHostGetDevicePointer_v2.restype = ctypes.c_int
    return lib


_MEMOPS = ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2", "cuMemHostGetDevicePointer_v2")


def _missing_memops(lib: ctypes.CDLL) -> list[str]:
    """The stream memory operations POLL uses that this driver lacks (the _v2 ones need no driver
    module option)."""
    return [n for n in _MEMOPS if not hasattr(lib, n)]


def _memop_driver(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the stream memory operations POLL uses typed."""
    for name in _MEMOPS[:2]:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != _CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


@dataclass
class _Layer:
    stacked: dict[str, torch.Tensor]  # the CPU experts of the layer, stacked, in host memory
    local: torch.Tensor  # int32 [E] on the device: expert id -> index in `stacked`, -1 elsewhere


@dataclass
class _Staging:
    x: torch.Tensor  # [M, D] bf16, host (page-locked on a GPU host)
    ids: torch.Tensor  # [M, k] int32, host
    rw: torch.Tensor  # [M, k] fp32, host
    y: torch.Tensor  # [M, k, D] bf16, host
    ids_dev: torch.Tensor  # [M, k] int32, device: the mapped ids before their copy
    y_dev: torch.Tensor  # [M, k, D] bf16, device
    job: cpu_experts.SidecarJob | None
    flag: torch.Tensor | None = None  # POLL: the job's flag word, int32 [1], page-locked
    flag_dev: int = 0  # its device address
    zc: _zc.ZeroCopyJob | None = None  # ZERO_COPY: the buffers the two kernels use (x, ids, rw, y, flag above)


class CpuSidecar:
    """The CPU experts of every layer that has some, and the machinery to run them beside the GPU.

    `start(L, x, idx, w)` enqueues layer L's CPU slots of this MoE call; `finish(handle, pairs)`
    makes the current stream wait for them and returns the GPU's per-slot outputs `pairs` [M, k, D]
    (zero at the CPU's slots) with the CPU's added there bit for bit (`add_pairs`; in place with
    ZERO_COPY)."""

    def __init__(self, device: torch.device, swiglu_limit: float, num_threads: int | None = None):
        self.device = torch.device(device)
        self.limit = float(swiglu_limit)
        self.num_threads = num_threads
        self.layers: dict[int, _Layer] = {}
        self._staging: dict[tuple[int, int], _Staging] = {}
        self._cuda = self.device.type == "cuda"
        self.zero_copy = ZERO_COPY and self._cuda
        if self.zero_copy and not _zc.supported(self.device):
            warnings.warn("the zero-copy sidecar needs nvcc to build its kernels: the CPU sidecar polls instead",
                          stacklevel=2)
            self.zero_copy = False
        self.poll = POLL and self._cuda and not self.zero_copy
        if self._cuda:
            lib = _driver()
            missing = _missing_memops(lib) if self.poll else []
            if missing:
                warnings.warn(f"this CUDA driver lacks {', '.join(missing)}: the CPU sidecar runs by host functions",
                              stacklevel=2)
                self.poll = False
            self._driver = _memop_driver(lib) if self.poll else lib
            self._fn = cpu_experts.sidecar_host_fn()
            self._side = torch.cuda.Stream(self.device)
        self._poller = cpu_experts.Poller() if self.poll or self.zero_copy else None
        self._err = torch.zeros(1, dtype=torch.int32, device=self.device) if self.zero_copy else None

    def add_layer(self, L: int, stacked: dict[str, torch.Tensor], expert_ids: list[int], n_experts: int) -> None:
        """Layer L's CPU experts: `stacked` (w13, w13_scale, w2, w2_scale, host tensors) holds
        experts `expert_ids` in that order."""
        local = torch.full((n_experts,), -1, dtype=torch.int32)
        local[torch.tensor(expert_ids, dtype=torch.long)] = torch.arange(len(expert_ids), dtype=torch.int32)
        self.layers[L] = _Layer({k: v.contiguous() for k, v in stacked.items()}, local.to(self.device))

    def _buffers(self, L: int, M: int, k: int, D: int) -> _Staging:
        key = (L, M)
        st = self._staging.get(key)
        if st is None:
            pin = self._cuda
            x = torch.empty(M, D, dtype=torch.bfloat16, pin_memory=pin)
            ids = torch.empty(M, k, dtype=torch.int32, pin_memory=pin)
            rw = torch.empty(M, k, dtype=torch.float32, pin_memory=pin)
            y = torch.zeros(M, k, D, dtype=torch.bfloat16, pin_memory=pin)
            lay = self.layers[L]
            job = cpu_experts.sidecar_job(x, ids, rw, lay.stacked["w13"], lay.stacked["w13_scale"], lay.stacked["w2"],
                                          lay.stacked["w2_scale"], y, self.limit,
                                          self.num_threads if self.num_threads is not None else THREADS)
            if job is None and self._cuda:
                raise RuntimeError("the CPU sidecar needs the compiled CPU expert kernel (megastep.cpu)")
            st = _Staging(x, ids, rw, y, torch.empty(M, k, dtype=torch.int32, device=self.device),
                          torch.empty(M, k, D, dtype=torch.bfloat16, device=self.device), job)
            if self._poller is not None:  # POLL or ZERO_COPY: the job's flag word, scanned by the CPU thread
                st.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                st.flag_dev = _zc.host_address(self._driver, st.flag)
                if self.zero_copy:
                    posted, calls = torch.zeros(2, 1, dtype=torch.int32, device=self.device)
                    st.zc = _zc.ZeroCopyJob(x, ids, rw, y, st.flag, st.ids_dev, posted, calls,
                                            self._err).map_host(self._driver)
                self._poller.add(job, st.flag)
            self._staging[key] = st
        return st

    def start(self, L: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> _Staging:
        M, D = x.shape
        k = idx.shape[1]
        if x.dtype != torch.bfloat16:
            raise ValueError("the CPU sidecar takes bf16 activations")
        st = self._buffers(L, M, k, D)
        if self.zero_copy:  # the kernel maps the ids and writes the host buffers itself
            x = x.contiguous()
            if x.data_ptr() % 16:  # (the kernel moves x in 16-byte words)
                x = x.clone()
            _zc.post(x, idx.to(torch.int32).contiguous(), w.to(torch.float32).contiguous(), self.layers[L].local, st.zc)
            return st
        torch.index_select(self.layers[L].local, 0, idx.reshape(-1).long(), out=st.ids_dev.view(-1))
        if not self._cuda:  # one thread of control: run it now
            st.x.copy_(x)
            st.ids.copy_(st.ids_dev)
            st.rw.copy_(w)
            if st.job is not None:
                cpu_experts.run_sidecar_job(st.job)
            else:  # no compiled kernel here: experts_forward falls back to its torch twin
                ex = self.layers[L].stacked
                cpu_experts.experts_forward(st.x, st.ids, st.rw, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"],
                                            self.limit, out=st.y.zero_())
            st.y_dev.copy_(st.y)
            return st
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)  # fork: x, idx, w and the mapped ids are ready
        with torch.cuda.stream(self._side):
            st.x.copy_(x, non_blocking=True)
            st.ids.copy_(st.ids_dev, non_blocking=True)
            st.rw.copy_(w, non_blocking=True)
            side = ctypes.c_void_p(self._side.cuda_stream)
            if self.poll:  # post the job, wait for the CPU thread's 2, then y and the reset
                d = self._driver
                _check(d.cuStreamWriteValue32_v2(side, st.flag_dev, 1, _WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
                _check(d.cuStreamWaitValue32_v2(side, st.flag_dev, 2, _WAIT_VALUE_EQ), "cuStreamWaitValue32")
                st.y_dev.copy_(st.y, non_blocking=True)
                _check(d.cuStreamWriteValue32_v2(side, st.flag_dev, 0, _WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
            else:
                _check(self._driver.cuLaunchHostFunc(side, ctypes.c_void_p(self._fn), ctypes.addressof(st.job)),
                       "cuLaunchHostFunc")
                st.y_dev.copy_(st.y, non_blocking=True)
        return st

    def finish(self, st: _Staging, pairs: torch.Tensor) -> torch.Tensor:
        if self.zero_copy:
            return _zc.collect(pairs, st.zc)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)  # join
        return add_pairs(pairs, st.y_dev)

    def check(self) -> None:
        """Raise if a zero-copy wait gave up on the CPU (~2 s: its thread is gone or stuck). Syncs."""
        if self._err is not None and int(self._err[0]):
            raise RuntimeError("the CPU sidecar did not answer within ~2 s: its experts' slots were left at zero")

    # ---- what the CPU did (the benchmark's report; the step never reads it) ----------------------
    def reset_counters(self) -> None:
        """Zero every job's counters. Only while no job is in flight (the GPU idle)."""
        for st in self._staging.values():
            if st.job is not None:
                st.job.reset_counters()
            if st.zc is not None:
                # (made by the first step, under the step's inference mode: only there may they change in place)
                with torch.inference_mode():
                    st.zc.calls.zero_()

    def report(self) -> dict | None:
        """The CPU's share of the steps run since `reset_counters`, per step: every job that ran
        since then ran once a step (one per layer with CPU experts, for the one batch size run);
        None when none ran (or no compiled kernel). A busy job is one that had a slot of its
        experts: `cpu_GBps` is the bytes of the distinct experts the busy jobs read over their wall
        time (zeroing y included), to hold against the CPU's streaming read (`cpu_read_bandwidth`)."""
        ran = []
        for (L, _), st in self._staging.items():
            if st.job is None:
                continue
            c = st.job.counters()
            if st.zc is not None:  # only posted jobs run: the kernel counts the calls
                c["runs"] = int(st.zc.calls[0])
            if c["runs"]:
                ran.append((L, c))
        if not ran:
            return None
        steps = max(c["runs"] for _, c in ran)
        busy = sum(c["busy_runs"] for _, c in ran)
        idle = sum(c["runs"] - c["busy_runs"] for _, c in ran)
        busy_ns = sum(c["busy_ns"] for _, c in ran)
        nbytes = sum(c["experts"] * self._expert_bytes(L) for L, c in ran)
        return {
            "steps": steps, "jobs_per_step": len(ran), "busy_jobs_per_step": busy / steps,
            "experts_per_step": sum(c["experts"] for _, c in ran) / steps,
            "busy_ms_per_step": busy_ns / steps / 1e6,
            "busy_job_us_mean": busy_ns / busy / 1e3 if busy else None,
            "busy_job_us_max": max(c["max_ns"] for _, c in ran) / 1e3 if busy else None,
            "idle_job_us_mean": sum(c["idle_ns"] for _, c in ran) / idle / 1e3 if idle else None,
            "cpu_GBps": nbytes / busy_ns if busy_ns else None,
        }

    def _expert_bytes(self, L: int) -> int:
        """Bytes of one of layer L's CPU experts (weights and scales)."""
        return sum(t[0].numel() * t.element_size() for t in self.layers[L].stacked.values())


def add_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two per-slot output buffers of which at most one is non-zero at every element, combined
    bit-exactly: their words added as integers (distributed.bit_words, as ordered_combine does)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    out = a.clone()
    bit_words(out).add_(bit_words(b))
    return out
