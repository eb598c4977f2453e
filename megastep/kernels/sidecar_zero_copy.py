"""Recipe B's CPU sidecar posted and collected on the step's own stream, through page-locked host
memory read and written in place by two small kernels (`sidecar_zero_copy.cu`): `runtime/sidecar.py`
with `ZERO_COPY`.

Shapes and dtypes (M rows, k slots a row, D hidden, E experts of the layer):
- `post(x, idx, w, local, job)`: x [M, D] bf16, idx [M, k] int32, w [M, k] fp32, local [E] int32 (an
  expert's index among the layer's CPU experts, -1 for the others), all on the device; `job` the
  layer's `ZeroCopyJob`. Writes job.dids [M, k] int32 = local[idx] (device); when any is >= 0, the
  job's host buffers (x, those ids, w) and then its host flag = 1 (the CPU thread runs the job and
  stores 2); job.posted = whether it did; job.calls += 1.
- `collect(pairs, job)`: pairs [M, k, D] bf16 (device; the GPU's per-slot expert outputs, zero at the
  CPU's slots). When posted: waits for the flag's 2, copies the host y's rows of the CPU's slots into
  pairs (over zero: bit for bit `add_pairs`), resets the flag to 0. A wait of more than ~2 s gives up
  and sets job.err (those slots stay zero) rather than hang the device.

References: `post_ref` and `collect_ref` (the same buffers, torch, synchronous).

Why: the polling sidecar (POLL) forks a side stream in every MoE sublayer with CPU experts, copies
x, ids and weights to the host, waits there for the CPU's flag, copies y back and joins, whether or
not the step routed a row to a CPU expert: recipe B measured 10.55 ms at one row against A's 7.27
(docs/PERFORMANCE.md, twenty-second and twenty-fifth measurements), though its CPU reads faster than
the host link. Here a layer whose rows chose no CPU expert costs two one-CTA launches and nothing on
the host; the others wait only at `collect`, after the GPU's own experts ran. Off until measured
(runtime/sidecar.ZERO_COPY).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from megastep.kernels.cuda_module import CudaModule, find_nvcc

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sidecar_zero_copy.cu")
_MODULE = CudaModule(SOURCE)
_POST = _MODULE.kernel("sidecar_post", "pppppppppppiii")
_COLLECT = _MODULE.kernel("sidecar_collect", "ppppppiii")
THREADS = 512


def supported(device: torch.device) -> bool:
    """A CUDA device and nvcc to build the kernels."""
    return torch.device(device).type == "cuda" and find_nvcc() is not None


@dataclass
class ZeroCopyJob:
    """One layer's buffers for one row count: the host ones are the CPU job's (page-locked; `*_dev`:
    their device-visible addresses), the rest on the device."""

    x: torch.Tensor  # [M, D] bf16, host
    ids: torch.Tensor  # [M, k] int32, host: CPU-local ids, -1 elsewhere
    rw: torch.Tensor  # [M, k] fp32, host
    y: torch.Tensor  # [M, k, D] bf16, host: the CPU's outputs
    flag: torch.Tensor  # [1] int32, host: 0 idle, 1 posted, 2 done
    dids: torch.Tensor  # [M, k] int32, device: local[idx]
    posted: torch.Tensor  # [1] int32, device
    calls: torch.Tensor  # [1] int32, device: posts tried (one a step)
    err: torch.Tensor  # [1] int32, device: a wait gave up
    x_dev: int = 0
    ids_dev: int = 0
    rw_dev: int = 0
    y_dev: int = 0
    flag_dev: int = 0

    def map_host(self, driver: ctypes.CDLL) -> ZeroCopyJob:
        """Fills the `*_dev` addresses of the host buffers (`host_address`); returns the job."""
        for name in ("x", "ids", "rw", "y", "flag"):
            setattr(self, name + "_dev", host_address(driver, getattr(self, name)))
        return self


def host_address(driver: ctypes.CDLL, t: torch.Tensor) -> int:
    """The device-visible address of page-locked host memory (cuMemHostGetDevicePointer)."""
    dev = ctypes.c_uint64()
    rc = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), ctypes.c_void_p(t.data_ptr()), 0)
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc}): is the buffer page-locked?")
    return dev.value


def _check_post(x, idx, w, local, job):
    M, D = x.shape
    k = idx.shape[1]
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0 and D % 8 == 0, (x.dtype, D)
    assert idx.dtype == torch.int32 and idx.is_contiguous() and tuple(idx.shape) == (M, k), (idx.dtype, idx.shape)
    assert w.dtype == torch.float32 and w.is_contiguous() and tuple(w.shape) == (M, k), (w.dtype, w.shape)
    assert local.dtype == torch.int32 and tuple(job.dids.shape) == (M, k) and tuple(job.x.shape) == (M, D)
    return M, D, k


def post(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, local: torch.Tensor, job: ZeroCopyJob) -> None:
    M, D, k = _check_post(x, idx, w, local, job)
    _POST.launch((1, 1, 1), (THREADS, 1, 1), 0, None, x, idx, w, local, job.x_dev, job.ids_dev, job.rw_dev, job.dids,
                 job.posted, job.calls, job.flag_dev, M, D, k)


def collect(pairs: torch.Tensor, job: ZeroCopyJob) -> torch.Tensor:
    M, k = job.dids.shape
    D = job.x.shape[1]
    assert pairs.dtype == torch.bfloat16 and pairs.is_contiguous() and pairs.numel() == M * k * D, (pairs.shape,)
    assert pairs.data_ptr() % 16 == 0
    _COLLECT.launch((1, 1, 1), (THREADS, 1, 1), 0, None, job.dids, job.posted, job.flag_dev, job.y_dev, pairs,
                    job.err, M, D, k)
    return pairs


def post_ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, local: torch.Tensor, job: ZeroCopyJob) -> None:
    _check_post(x, idx, w, local, job)
    job.dids.copy_(local[idx.long()])
    any_cpu = bool((job.dids >= 0).any())
    if any_cpu:
        job.ids.copy_(job.dids)
        job.rw.copy_(w)
        job.x.copy_(x)
        job.flag.fill_(1)
    job.posted.fill_(int(any_cpu))
    job.calls.add_(1)


def collect_ref(pairs: torch.Tensor, job: ZeroCopyJob) -> torch.Tensor:
    """The CPU has run the posted job (flag 2) before this is called: it is synchronous."""
    if int(job.posted[0]):
        if int(job.flag[0]) != 2:
            raise RuntimeError("collect_ref: the posted job has not run")
        cpu = (job.dids >= 0).to(pairs.device)
        view = pairs.view(*job.dids.shape, -1)
        view[cpu] = job.y.to(pairs.device)[cpu]
        job.flag.fill_(0)
    return pairs
