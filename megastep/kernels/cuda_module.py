"""Hand-written CUDA C++ kernels, built with nvcc into a cubin and launched through the driver API.

Some kernels need what Triton cannot express (register/shared-memory layouts, warp-level data
movement chosen by hand); those are written in CUDA C++ as `extern "C" __global__` functions. They
are built as a plain cubin (`nvcc --cubin`: no torch headers, no host code, a few seconds) and
launched with `cuLaunchKernel` via ctypes on the current torch stream, so a launch is recorded by
CUDA graph capture like any Triton or torch launch. No torch C++ extension and no cudart are
involved.

Caching: `build_cubin` keys a cubin by sha256 of (source bytes, the bytes of the files it includes
with `#include "..."` beside it, recursively, nvcc flags, arch, `nvcc --version`) under
~/.cache/megastep/cuda/; it is written to a temporary file and renamed into place, so processes
building the same kernel at once never read a partial file. In a process a `CudaModule`
builds once and loads once per device; the first launch (or `attributes()`) on a device loads the
module, which is not allowed during stream capture: launch once before capturing (as with Triton).

Numerics are IEEE: no -use_fast_math.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading

import torch


class CudaUnavailable(RuntimeError):
    """The CUDA toolchain or driver needed to build or load a hand-written kernel is missing or failed."""


# ---- building -----------------------------------------------------------------------------


def find_nvcc() -> str | None:
    """nvcc on PATH, else in $CUDA_HOME/bin, else in /usr/local/cuda/bin; None when there is none."""
    path = shutil.which("nvcc")
    if path:
        return path
    home = os.environ.get("CUDA_HOME")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + ["/usr/local/cuda/bin/nvcc"]:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "megastep", "cuda")


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    # part of the cache key: a new toolkit must rebuild every kernel
    r = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise CudaUnavailable(f"`{nvcc} --version` failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    return r.stdout


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _sources(path: str, seen: set[str] | None = None) -> list[bytes]:
    """The bytes of `path` and of the files it includes with quotes (relative to it), each once."""
    seen = set() if seen is None else seen
    path = os.path.realpath(path)
    if path in seen:
        return []
    seen.add(path)
    with open(path, "rb") as f:
        text = f.read()
    out = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        inc = os.path.join(os.path.dirname(path), name.decode())
        if os.path.isfile(inc):  # else nvcc finds it elsewhere (or fails, with its own message)
            out += _sources(inc, seen)
    return out


def build_cubin(source_path: str, arch: str = "sm_90", extra_flags: tuple[str, ...] = ()) -> bytes:
    """The cubin of `source_path` for `arch` (e.g. "sm_90", "sm_90a"), from the cache or built by nvcc."""
    m = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if m is None:
        raise ValueError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaUnavailable(f"cannot build {source_path}: nvcc was not found on PATH, in $CUDA_HOME/bin "
                              "or in /usr/local/cuda/bin (install the CUDA toolkit)")
    flags = ["--cubin", f"-gencode=arch=compute_{m.group(1)},code={arch}", "-O3", "-std=c++17", "-lineinfo",
             *extra_flags]
    h = hashlib.sha256()
    for text in _sources(source_path):
        h.update(text)
    h.update(json.dumps([flags, arch, _nvcc_version(nvcc)]).encode())
    d = cache_dir()
    final = os.path.join(d, h.hexdigest() + ".cubin")
    try:
        with open(final, "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    os.makedirs(d, exist_ok=True)
    # nvcc writes a private temporary name in the cache dir; os.replace (atomic on one filesystem)
    # then publishes it, so a concurrent reader sees either no file or the whole cubin
    fd, tmp = tempfile.mkstemp(dir=d, prefix=h.hexdigest()[:16] + ".", suffix=".tmp")
    os.close(fd)
    try:
        r = subprocess.run([nvcc, *flags, "-o", tmp, source_path], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise CudaUnavailable(f"nvcc failed to build {source_path} for {arch} (exit {r.returncode}):\n"
                                  f"{_tail(r.stderr or r.stdout)}")
        with open(tmp, "rb") as f:
            cubin = f.read()
        os.replace(tmp, final)
        return cubin
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- the driver ---------------------------------------------------------------------------

_driver_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_STATIC_SHARED_LIMIT = 48 * 1024  # beyond this a launch must opt in per function


def _driver() -> ctypes.CDLL:
    """libcuda, loaded and initialized on first use (importing this module touches no driver)."""
    global _lib
    with _driver_lock:
        if _lib is not None:
            return _lib
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaUnavailable(f"cannot load the CUDA driver library libcuda.so.1 ({e})") from e
        p, pp, i32, u32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint
        sigs = {
            "cuInit": [u32],
            "cuGetErrorName": [i32, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(i32), i32],
            "cuDevicePrimaryCtxRetain": [pp, i32],
            "cuCtxGetCurrent": [pp],
            "cuCtxSetCurrent": [p],
            "cuCtxPushCurrent_v2": [p],  # what cuda.h maps cuCtxPushCurrent/PopCurrent to
            "cuCtxPopCurrent_v2": [pp],
            "cuModuleLoadData": [pp, p],
            "cuModuleGetFunction": [pp, p, ctypes.c_char_p],
            "cuFuncGetAttribute": [ctypes.POINTER(i32), i32, p],
            "cuFuncSetAttribute": [p, i32, i32],
            "cuLaunchKernel": [p, u32, u32, u32, u32, u32, u32, u32, p, pp, pp],
            "cuLaunchKernelEx": [p, p, pp, pp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        rc = lib.cuInit(0)
        if rc != 0:
            raise CudaUnavailable(f"cuInit failed: {_error_name(lib, rc)}")
        _lib = lib
        return lib


def _error_name(lib: ctypes.CDLL, rc: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {rc}"
    return name.value.decode()


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_error_name(lib, rc)}")


def _primary_context(lib: ctypes.CDLL, device: int) -> int:
    """Make `device`'s primary context (the one torch's runtime uses) current on this thread; the
    caller has made `device` torch's current device, which makes that context current through the runtime."""
    cur = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        # the retained reference is never released: the modules loaded into it live as long as the process
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        cur = ctx
    return cur.value


# ---- modules and kernels ------------------------------------------------------------------

_ARG_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "I": ctypes.c_uint32, "q": ctypes.c_int64,
              "f": ctypes.c_float}


# cuLaunchKernelEx's configuration (cuda.h, CUDA 12+): one launch attribute, programmatic stream
# serialization (PDL: the kernel may start before its predecessor on the stream has completed;
# it orders itself with griddepcontrol.wait)
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class _Function:
    """One kernel loaded on one device: its context, its CUfunction, the dynamic shared memory it may use."""

    __slots__ = ("ctx", "handle", "max_dynamic_shared")

    def __init__(self, ctx: int, handle: int):
        self.ctx, self.handle, self.max_dynamic_shared = ctx, handle, _STATIC_SHARED_LIMIT


class CudaModule:
    """The `extern "C" __global__` kernels of one .cu file. Nothing is built or loaded until a kernel
    is first launched (or `cubin()` / `Kernel.attributes()` is called)."""

    def __init__(self, source_path: str, arch: str = "sm_90", extra_flags: tuple[str, ...] = ()):
        self.source_path, self.arch, self.extra_flags = source_path, arch, tuple(extra_flags)
        self._lock = threading.Lock()
        self._cubin: bytes | None = None
        self._modules: dict[int, tuple[int, int]] = {}  # device -> (context, CUmodule)
        self._functions: dict[tuple[int, str], _Function] = {}

    def cubin(self) -> bytes:
        """The built cubin (built on first call; call it at startup to surface build errors early)."""
        with self._lock:
            if self._cubin is None:
                self._cubin = build_cubin(self.source_path, self.arch, self.extra_flags)
            return self._cubin

    def kernel(self, name: str, signature: str) -> Kernel:
        return Kernel(self, name, signature)

    def _function(self, device: int, name: str) -> _Function:
        cubin = self.cubin()
        lib = _driver()
        with self._lock:
            fn = self._functions.get((device, name))
            if fn is not None:
                return fn
            if device not in self._modules:
                torch.cuda.init()
                with torch.cuda.device(device):  # restores the caller's current device afterwards
                    ctx = _primary_context(lib, device)
                    mod = ctypes.c_void_p()
                    _check(lib, lib.cuModuleLoadData(ctypes.byref(mod), cubin),
                           f"cuModuleLoadData({self.source_path})")
                self._modules[device] = (ctx, mod.value)  # never unloaded: captured graphs may use it
            ctx, mod = self._modules[device]
            h = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(h), mod, name.encode()),
                   f"cuModuleGetFunction({name!r} in {self.source_path})")
            fn = self._functions[(device, name)] = _Function(ctx, h.value)
            return fn


class Kernel:
    """One kernel of a `CudaModule`, with its argument signature: one character per argument,
    'p' pointer (tensor or int address), 'i' int32, 'I' uint32, 'q' int64, 'f' float32."""

    def __init__(self, module: CudaModule, name: str, signature: str):
        bad = set(signature) - set(_ARG_TYPES)
        if bad:
            raise ValueError(f"unknown signature characters {sorted(bad)} in {signature!r} (use {''.join(_ARG_TYPES)})")
        self.module, self.name, self.signature = module, name, signature
        self._types = tuple(_ARG_TYPES[c] for c in signature)  # resolved once, not per launch
        self._pointer = tuple(c == "p" for c in signature)
        self._params_type = ctypes.c_void_p * max(len(signature), 1)
        self._fns: dict[int, _Function] = {}  # device -> function: the launch path's only lookup

    def _fn(self, device: int) -> _Function:
        fn = self._fns.get(device)
        if fn is None:
            fn = self._fns[device] = self.module._function(device, self.name)
        return fn

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: torch.cuda.Stream | int | None, *args, pdl: bool = False) -> None:
        """Enqueue the kernel on `stream` (None: torch's current stream; int: a raw CUstream on the
        current device). Captured by a CUDA graph when the stream is capturing. pdl: launched with
        programmatic stream serialization (the kernel may start while its predecessor drains; it
        must wait with griddepcontrol.wait before touching what the predecessor writes)."""
        if len(args) != len(self._types):
            raise TypeError(f"{self.name} takes {len(self._types)} arguments ({self.signature!r}), got {len(args)}")
        if stream is None:
            device = torch.cuda.current_device()
            handle = torch.cuda.current_stream(device).cuda_stream
        elif isinstance(stream, int):
            device, handle = torch.cuda.current_device(), stream
        else:
            device, handle = stream.device_index, stream.cuda_stream
        fn = self._fn(device)
        lib = _lib
        if shared_bytes > fn.max_dynamic_shared:
            _check(lib, lib.cuFuncSetAttribute(fn.handle, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               shared_bytes), f"cuFuncSetAttribute({self.name}, {shared_bytes} B)")
            fn.max_dynamic_shared = shared_bytes
        # `vals` keeps the ctypes values alive until cuLaunchKernel has copied them
        vals = [t(a.data_ptr() if p and isinstance(a, torch.Tensor) else a)
                for t, p, a in zip(self._types, self._pointer, args)]
        params = self._params_type(*[ctypes.addressof(v) for v in vals])
        cur = ctypes.c_void_p()
        _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        switch = cur.value != fn.ctx  # e.g. a thread where torch has not touched this device yet
        if switch:
            _check(lib, lib.cuCtxPushCurrent_v2(fn.ctx), "cuCtxPushCurrent")
        try:
            gx, gy, gz = grid
            bx, by, bz = block
            if pdl:
                attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
                cfg = _LaunchConfig(gx, gy, gz, bx, by, bz, shared_bytes, handle, ctypes.pointer(attr), 1)
                _check(lib, lib.cuLaunchKernelEx(ctypes.byref(cfg), fn.handle, params, None),
                       f"cuLaunchKernelEx({self.name}, PDL)")
            else:
                _check(lib, lib.cuLaunchKernel(fn.handle, gx, gy, gz, bx, by, bz, shared_bytes, handle, params, None),
                       f"cuLaunchKernel({self.name})")
        finally:
            if switch:
                lib.cuCtxPopCurrent_v2(ctypes.byref(cur))

    def attributes(self, device: int | None = None) -> dict[str, int]:
        """Registers per thread, local memory (spills) per thread, static shared memory, and the
        largest block the compiled kernel allows, on `device` (default: the current one)."""
        fn = self._fn(torch.cuda.current_device() if device is None else device)
        lib = _lib
        out = {}
        for key, attr in (("num_regs", _CU_FUNC_ATTRIBUTE_NUM_REGS),
                          ("local_size_bytes", _CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                          ("shared_size_bytes", _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                          ("max_threads_per_block", _CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)):
            v = ctypes.c_int()
            _check(lib, lib.cuFuncGetAttribute(ctypes.byref(v), attr, fn.handle), f"cuFuncGetAttribute({self.name})")
            out[key] = v.value
        return out
