"""Routed MXFP4 experts computed on the CPU: the kernel of the CPU sidecar (issue 4, Recipe B).

`expert_forward` (one expert, M rows) and `experts_forward` (several experts of one layer, per-slot
outputs [M, k, D]) read the checkpoint's MXFP4 bytes directly and follow, per (row, slot), the
semantics of `megastep.kernels.moe.moe_experts_mxfp4_ref` (bf16 activations):

    q = fp8_act_sim(x, 128);  g = rnd(w1 . q);  u = rnd(w3 . q)           rnd = round to bf16
    a = rnd(r * (silu(min(g, limit)) * clamp(u, -limit, limit)))
    y = rnd(w2 . fp8_act_sim(a, 128))

The per-slot outputs are kept apart: the GPU sums a row's slots in its fixed order, whichever path
computed each of them.

The work is done by `mxfp4_gemv.cpp`, JIT-built on first use with torch.utils.cpp_extension.load
(plain C entry points, no torch headers: ~2 s to build) into ~/.cache/megastep/cpu_ext/, and called
through ctypes, which releases the GIL during the call. The build is portable (-O3, no
-march=native); the ISA path is picked at run time: avx512bf16 > avx512 > scalar (see the .cpp).
If the build fails, a warning says why and every call runs `experts_forward_ref` (torch) instead.

Numerics: all paths accumulate in fp32 and differ from the torch reference only in the order of
the fp32 sums (the bf16 outputs agree within one bf16 step almost everywhere; tests count the
rest). Same input, same bits: for any thread count, and for a row alone or among other rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import platform
import sys
import threading
import warnings

import torch
import torch.nn.functional as F

from megastep.checkpoint import formats

ACT_BLOCK = 128
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")  # index = the kernel's isa code

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxfp4_gemv.cpp")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the compiled kernel is unavailable (None: not tried yet, or fine)
_tried = False


def build_dir() -> str:
    """Per-interpreter/torch/architecture cache of the compiled kernel (portable across CPUs of one
    architecture: the ISA is chosen at run time)."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = f"{py}_torch{torch.__version__.split('+')[0]}_{platform.machine()}"
    return os.path.join(os.path.expanduser("~"), ".cache", "megastep", "cpu_ext", tag)


def _load() -> ctypes.CDLL | None:
    global _lib, _error, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            from torch.utils import cpp_extension

            d = build_dir()
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "build.flock"), "a") as held:
                # torch serializes builds with a plain file (`lock`) and waits while it exists: a build killed
                # mid-way (Ctrl-C, a killed test run) leaves it, and every later process would wait forever.
                # This flock is released by the kernel when its process dies, so whoever holds it is the only
                # megastep build of this directory, and a `lock` it finds is stale.
                fcntl.flock(held, fcntl.LOCK_EX)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(d, "lock"))
                path = cpp_extension.load(
                    name="megastep_cpu_experts",
                    sources=[_SOURCE],
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=d,
                    is_python_module=False,
                    verbose=False,
                )
            lib = ctypes.CDLL(path)
            i64, i32, p, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
            lib.ms_cpu_isa_supported.argtypes, lib.ms_cpu_isa_supported.restype = [i32], i32
            lib.ms_cpu_best_isa.argtypes, lib.ms_cpu_best_isa.restype = [], i32
            lib.ms_experts_forward.argtypes = [p, i64, i64, i64, i64, p, p, i64, p, p, p, p, f32, p, i32, i32]
            lib.ms_experts_forward.restype = i32
            lib.ms_sidecar_run.argtypes, lib.ms_sidecar_run.restype = [p], None
            lib.ms_sidecar_job_size.argtypes, lib.ms_sidecar_job_size.restype = [], i64
            lib.ms_poller_start.argtypes, lib.ms_poller_start.restype = [], p
            lib.ms_poller_add.argtypes, lib.ms_poller_add.restype = [p, p, p], i32
            lib.ms_poller_stop.argtypes, lib.ms_poller_stop.restype = [p], None
            _lib = lib
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use torch
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(
                f"megastep.cpu: the compiled MXFP4 expert kernel is unavailable ({_error}); "
                "CPU experts run the slow torch implementation instead",
                RuntimeWarning,
                stacklevel=3,
            )
        return _lib


def available_isas() -> list[str]:
    """ISA paths this CPU can run with the compiled kernel ([] when it failed to build)."""
    lib = _load()
    return [n for i, n in enumerate(ISA_NAMES) if lib is not None and lib.ms_cpu_isa_supported(i)]


def backend() -> str:
    """What `experts_forward` runs here: the best ISA path, or 'torch (...why...)'."""
    lib = _load()
    if lib is None:
        return f"torch (compiled kernel unavailable: {_error})"
    return ISA_NAMES[lib.ms_cpu_best_isa()]


def _isa_code(lib: ctypes.CDLL, isa: str | None) -> int:
    if isa is None:
        return lib.ms_cpu_best_isa()
    if isa not in ISA_NAMES:
        raise ValueError(f"isa must be one of {ISA_NAMES}, got {isa!r}")
    code = ISA_NAMES.index(isa)
    if not lib.ms_cpu_isa_supported(code):
        raise ValueError(f"this CPU cannot run the {isa} path (it can: {available_isas()})")
    return code


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e8m0fnu, torch.int8) else t


def _check(x, ids, weights, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int, int, int]:
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be [M, D] bfloat16, got {tuple(x.shape)} {x.dtype}")
    M, D = x.shape
    if w13.dim() != 3:
        raise ValueError(f"stacked w13 must be [E, 2I, D/2], got {tuple(w13.shape)}")
    E, two_i, dh = w13.shape
    I = two_i // 2
    if D % 32 or I % 32 or dh * 2 != D or two_i != 2 * I:
        raise ValueError(f"MXFP4 experts need D, I multiples of 32: x {tuple(x.shape)}, w13 {tuple(w13.shape)}")
    want = {"w13_scale": (E, 2 * I, D // 32), "w2": (E, D, I // 2), "w2_scale": (E, D, I // 32)}
    for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(t.shape)}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"{name} must hold packed e2m1 bytes (int8), got {t.dtype}")
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise ValueError(f"{name} must be E8M0 (float8_e8m0fnu or uint8), got {t.dtype}")
    if ids.dim() != 2 or ids.shape[0] != M or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"ids and weights must be [M, k]: {tuple(ids.shape)}, {tuple(weights.shape)}")
    for t in (x, ids, weights, w13, w13_scale, w2, w2_scale):
        if t.device.type != "cpu":
            raise ValueError("CPU experts take CPU tensors")
    return M, D, I, E, ids.shape[1]


def experts_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float = 10.0,
    *,
    isa: str | None = None,
    num_threads: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, D] bf16, ids [M, k] (int32/int64; an id < 0 skips the slot), weights [M, k] fp32,
    stacked experts of one layer (w13 int8 [E, 2I, D/2], w13_scale E8M0 [E, 2I, D/32], w2 int8
    [E, D, I/2], w2_scale E8M0 [E, D, I/32]) -> per-slot outputs y [M, k, D] bf16 (skipped slots
    zero, or left as they are in `out`). `isa` forces a path ('scalar', 'avx512', 'avx512bf16');
    `num_threads` defaults to torch.get_num_threads() of the calling thread."""
    M, D, I, E, k = _check(x, ids, weights, w13, w13_scale, w2, w2_scale)
    if out is None:
        out = torch.zeros(M, k, D, dtype=torch.bfloat16)
    elif (tuple(out.shape) != (M, k, D) or out.dtype != torch.bfloat16 or not out.is_contiguous()
          or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU bfloat16 [M, k, D] = {(M, k, D)} tensor")
    lib = _load()
    if lib is None:
        y = experts_forward_ref(x, ids, weights, w13, w13_scale, w2, w2_scale, limit)
        keep = (ids >= 0)[..., None]
        out.copy_(torch.where(keep, y, out))
        return out
    code = _isa_code(lib, isa)
    nt = int(num_threads) if num_threads is not None else torch.get_num_threads()
    xs = x.contiguous()
    ids32 = ids.to(torch.int32).contiguous()
    rw = weights.to(torch.float32).contiguous()
    t13, s13, t2, s2 = (_u8(t).contiguous() for t in (w13, w13_scale, w2, w2_scale))
    rc = lib.ms_experts_forward(
        xs.data_ptr(), M, D, I, k, ids32.data_ptr(), rw.data_ptr(), E,
        t13.data_ptr(), s13.data_ptr(), t2.data_ptr(), s2.data_ptr(), float(limit), out.data_ptr(), code, max(1, nt),
    )
    if rc != 0:
        raise ValueError(f"experts_forward: expert ids must be < E = {E} (got max {int(ids.max())})")
    return out


def expert_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    routing_weight: torch.Tensor,
    limit: float = 10.0,
    *,
    isa: str | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """One expert for M rows: x [M, D] bf16, w13 int8 [2I, D/2], w13_scale E8M0 [2I, D/32], w2 int8
    [D, I/2], w2_scale E8M0 [D, I/32], routing_weight [M] fp32 -> y [M, D] bf16."""
    M = x.shape[0]
    ids = torch.zeros(M, 1, dtype=torch.int32)
    y = experts_forward(x, ids, routing_weight.reshape(M, 1), w13[None], w13_scale[None], w2[None], w2_scale[None],
                        limit, isa=isa, num_threads=num_threads)
    return y[:, 0]


# ---- torch reference (also the fallback) -------------------------------------------------------
def expert_forward_ref(x, w13, w13_scale, w2, w2_scale, routing_weight, limit: float = 10.0) -> torch.Tensor:
    """Plain torch, per expert: the per-slot math of `moe_experts_mxfp4_ref` (dequantize + matmul)."""
    dt = x.dtype
    I = w13.shape[0] // 2
    lim = float(limit)
    q = formats.fp8_act_sim(x.float(), ACT_BLOCK)
    h = q @ formats.dequantize_mxfp4_weight(w13, w13_scale).T
    g = h[:, :I].to(dt).float().clamp(max=lim)
    u = h[:, I:].to(dt).float().clamp(-lim, lim)
    a = (routing_weight.reshape(-1, 1).float() * (F.silu(g) * u)).to(dt).float()
    a = formats.fp8_act_sim(a, ACT_BLOCK)
    return (a @ formats.dequantize_mxfp4_weight(w2, w2_scale).T).to(dt)


def experts_forward_ref(x, ids, weights, w13, w13_scale, w2, w2_scale, limit: float = 10.0) -> torch.Tensor:
    """`experts_forward` in torch: y [M, k, D] bf16, zero for slots with id < 0."""
    M, D = x.shape
    k = ids.shape[1]
    y = torch.zeros(M, k, D, dtype=x.dtype)
    idl = ids.long()
    for e in torch.unique(idl[idl >= 0]).tolist():
        rows, slots = (idl == e).nonzero(as_tuple=True)
        y[rows, slots] = expert_forward_ref(x[rows], w13[e], w13_scale[e], w2[e], w2_scale[e],
                                            weights[rows, slots], limit)
    return y


# ---- sidecar jobs: one layer's cold experts, run by the CUDA driver as a host function -----------
class SidecarJob(ctypes.Structure):
    """Mirror of `MsSidecarJob` in mxfp4_gemv.cpp: the arguments of one experts_forward call over
    fixed buffers (page-locked on a GPU host). `ms_sidecar_run(&job)` zeroes y, then writes the
    slots whose id >= 0. Its counters (`COUNTERS`) say what the runs did: see `counters`."""

    COUNTERS = ("runs", "busy_runs", "experts", "busy_ns", "max_ns", "idle_ns")
    _fields_ = [
        ("x", ctypes.c_void_p), ("M", ctypes.c_int64), ("D", ctypes.c_int64), ("I", ctypes.c_int64),
        ("k", ctypes.c_int64), ("ids", ctypes.c_void_p), ("rw", ctypes.c_void_p), ("E", ctypes.c_int64),
        ("w13", ctypes.c_void_p), ("w13s", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("w2s", ctypes.c_void_p),
        ("limit", ctypes.c_float), ("y", ctypes.c_void_p), ("isa", ctypes.c_int), ("nthreads", ctypes.c_int),
        ("status", ctypes.c_int),
    ] + [(name, ctypes.c_int64) for name in COUNTERS]

    def counters(self) -> dict[str, int]:
        """The runs since the last reset: all of them; those with a slot of this job's experts
        ("busy"), the distinct experts they read, their wall time in ns (sum and longest); the wall
        time of the others (zeroing y only). Read them only while no run is in flight."""
        return {name: int(getattr(self, name)) for name in self.COUNTERS}

    def reset_counters(self) -> None:
        for name in self.COUNTERS:
            setattr(self, name, 0)


def sidecar_job(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                w2: torch.Tensor, w2_scale: torch.Tensor, out: torch.Tensor, limit: float = 10.0,
                num_threads: int | None = None) -> SidecarJob | None:
    """A job over these (contiguous, CPU) buffers: x [M, D] bf16, ids [M, k] int32 (< 0: not this
    job's slot), weights [M, k] fp32, stacked experts, out [M, k, D] bf16. The caller keeps every
    tensor alive and unmoved while the job may run. None when the compiled kernel is unavailable."""
    M, D, I, E, k = _check(x, ids, weights, w13, w13_scale, w2, w2_scale)
    for name, t, dt in (("x", x, torch.bfloat16), ("ids", ids, torch.int32), ("weights", weights, torch.float32),
                        ("out", out, torch.bfloat16)):
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"sidecar buffer {name} must be contiguous {dt}")
    if tuple(out.shape) != (M, k, D):
        raise ValueError(f"out must be [M, k, D] = {(M, k, D)}")
    lib = _load()
    if lib is None:
        return None
    if lib.ms_sidecar_job_size() != ctypes.sizeof(SidecarJob):  # the mirror and the C struct disagree: a bug
        raise RuntimeError(f"SidecarJob is {ctypes.sizeof(SidecarJob)} bytes, MsSidecarJob "
                           f"{lib.ms_sidecar_job_size()}: update the mirror in megastep/cpu/experts.py")
    t13, s13, t2, s2 = (_u8(t) for t in (w13, w13_scale, w2, w2_scale))
    for t in (t13, s13, t2, s2):
        if not t.is_contiguous():
            raise ValueError("stacked experts must be contiguous")
    nt = int(num_threads) if num_threads is not None else torch.get_num_threads()
    return SidecarJob(x.data_ptr(), M, D, I, k, ids.data_ptr(), weights.data_ptr(), E, t13.data_ptr(), s13.data_ptr(),
                      t2.data_ptr(), s2.data_ptr(), float(limit), out.data_ptr(), lib.ms_cpu_best_isa(), max(1, nt), 0)


def sidecar_host_fn() -> int:
    """Address of `ms_sidecar_run` (a CUhostFn), for cuLaunchHostFunc."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the compiled CPU expert kernel is unavailable: {_error}")
    return ctypes.cast(lib.ms_sidecar_run, ctypes.c_void_p).value


def run_sidecar_job(job: SidecarJob) -> None:
    """Run a job now, on this thread (what the host function does)."""
    _load().ms_sidecar_run(ctypes.byref(job))
    if job.status != 0:
        raise ValueError("sidecar job: bad arguments (expert id >= E?)")


class Poller:
    """A CPU thread that runs sidecar jobs when their flag words say so (`ms_poller_*` in
    mxfp4_gemv.cpp): a job's flag (one int32, page-locked on a GPU host) is set to 1 by its poster
    once the inputs are in place; the thread runs the job, then stores 2. The poster resets it to
    0. `close()` stops and joins the thread; no job may be posted after it."""

    def __init__(self):
        lib = _load()
        if lib is None:
            raise RuntimeError(f"the compiled CPU expert kernel is unavailable: {_error}")
        self._lib, self._handle = lib, lib.ms_poller_start()
        self._held: list = []  # the registered jobs and flags: alive while the thread may read them

    def add(self, job: SidecarJob, flag: torch.Tensor) -> None:
        if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device.type != "cpu":
            raise ValueError("a poller flag is one int32 in host memory")
        if self._handle is None:
            raise RuntimeError("the poller is closed")
        if self._lib.ms_poller_add(self._handle, ctypes.addressof(job), flag.data_ptr()) != 0:
            raise RuntimeError("the poller holds its maximum number of jobs")
        self._held.append((job, flag))

    def close(self) -> None:
        if self._handle is not None:
            self._lib.ms_poller_stop(self._handle)
            self._handle = None

    def __del__(self):
        self.close()
