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

Staging buffers and jobs are made per (layer, rows) on first use and kept: a captured graph
points at them. The CPU experts' weights stay where the caller put them (host memory); the job
holds their addresses.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from megastep.cpu import experts as cpu_experts
from megastep.runtime.distributed import bit_words

_CUDA_SUCCESS = 0


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    return lib


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


class CpuSidecar:
    """The CPU experts of every layer that has some, and the machinery to run them beside the GPU.

    `start(L, x, idx, w)` enqueues layer L's CPU slots of this MoE call; `finish(handle)` makes the
    current stream wait for them and returns their per-slot outputs [M, k, D] (x's dtype, zero at
    the slots of other experts) on x's device."""

    def __init__(self, device: torch.device, swiglu_limit: float, num_threads: int | None = None):
        self.device = torch.device(device)
        self.limit = float(swiglu_limit)
        self.num_threads = num_threads
        self.layers: dict[int, _Layer] = {}
        self._staging: dict[tuple[int, int], _Staging] = {}
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._driver = _driver()
            self._fn = cpu_experts.sidecar_host_fn()
            self._side = torch.cuda.Stream(self.device)

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
                                          lay.stacked["w2_scale"], y, self.limit, self.num_threads)
            if job is None and self._cuda:
                raise RuntimeError("the CPU sidecar needs the compiled CPU expert kernel (megastep.cpu)")
            st = _Staging(x, ids, rw, y, torch.empty(M, k, dtype=torch.int32, device=self.device),
                          torch.empty(M, k, D, dtype=torch.bfloat16, device=self.device), job)
            self._staging[key] = st
        return st

    def start(self, L: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> _Staging:
        M, D = x.shape
        k = idx.shape[1]
        if x.dtype != torch.bfloat16:
            raise ValueError("the CPU sidecar takes bf16 activations")
        st = self._buffers(L, M, k, D)
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
            rc = self._driver.cuLaunchHostFunc(ctypes.c_void_p(self._side.cuda_stream), ctypes.c_void_p(self._fn),
                                               ctypes.addressof(st.job))
            if rc != _CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")
            st.y_dev.copy_(st.y, non_blocking=True)
        return st

    def finish(self, st: _Staging) -> torch.Tensor:
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)  # join
        return st.y_dev


def add_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two per-slot output buffers of which at most one is non-zero at every element, combined
    bit-exactly: their words added as integers (distributed.bit_words, as ordered_combine does)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    out = a.clone()
    bit_words(out).add_(bit_words(b))
    return out
