"""The kernels of a V4-Flash decode step compiled for an H200 on this CPU machine and packed as the
device's compile caches, so that a device call does not spend its first minute compiling.

    <python 3.12 with triton 3.6.0 and torch> benchmarks/kernels/precompile.py \\
        [--rows 1,2,4,8,16,32,64] [--context 4096] [--arm NAME=STATEMENTS]... [--out build/device_cache.tgz]
    python3 benchmarks/kernels/precompile.py --pack OUT     # (on the device, h200_checks.sh's last step)

Then carry the archive on the device call (`run`'s carry: build/device_cache.tgz); h200_checks.sh
unpacks it before its steps, says last how many kernels the call still compiled, and packs what the
call compiled or was given (--pack) into its $OUT for the next call to carry: those keys are the
device's own, the Triton launchers' modules included (24 for the step, built with the host's C
compiler on first use; not built here).

Why: a device call's first step process took 60-111 s against 20-38 s for the same process run again
in the call (docs/data/m2*-summary-*.txt, the first arm of each call; one call's first arm ran out
of its 90 s). The difference is compiling, out of a session's 30 device minutes: the step's Triton
kernels one at a time at first launch (the default step at 1-64 rows is ~120 distinct kernels,
~40 s of compiling on this 2-core CPU machine) and the CUDA C++ modules (~6 s).

How. Triton's file cache keys a compiled kernel by a hash of Triton's own files (libtriton
included), the kernel's source and specialization (argument types, the ints equal to 1 or multiples
of 16, the pointers aligned to 16 bytes), the target, ptxas's version, the compile options and the
environment variables that change a compile: nothing of the machine that compiles it. So the
device's Triton wheel (3.6.0 for CPython 3.12, with its ptxas) compiles the same kernels under the
same keys here. Triton's own launcher is run, with a stand-in driver that reports an sm_90 GPU
(capability 9.0, 32-lane warps) and with every launch made a warm-up (compile, no launch), over a
step at each row count of a FastDecoder of V4-Flash width built on the CPU with uninitialized
weights (kernel_lint.v4_flash_decoder: a layer of each kind the 30-layer bench has; the kernels do
not depend on the layer count: 6 and 20 tiny layers compile the same 77 keys), made to take the
H200's paths: its launch options (PDL up to FastDecoder.PDL_MAX_ROWS rows, register caps, 132
SMs), its side streams (stand-ins that order nothing) and the CUDA C++ experts and routing with the
Triton launches around them (their own launches skipped). Each --arm's statements (ab_step.py's
arms: module settings) are in effect for a pass of its own, then put back. The cache is written
under CACHE_ROOT, an absolute path that the device unpacks to as well: a Triton cache entry names
its files by absolute path. The CUDA C++ modules' cubins are built too (cuda_module.build_cubin's
cache, keyed by source, flags and `nvcc --version`: a device whose nvcc prints another version
rebuilds them, a few seconds).

Not covered (compiled on the device as before): the GPU tests' kernels, the benchmarks' own, and a
decoder built with other arguments than the bench's defaults (e.g. --shared-after-router). A
pointer aligned differently there than here would change a key (never seen to differ: the CPU's
allocations are 64-byte aligned, the GPU's 512). h200_checks.sh's last line says how many kernels a
device call still compiled.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernel_lint as KL  # noqa: E402

CACHE_ROOT = "/tmp/megastep-device-cache"  # where the caches are built here and unpacked on the device
DEVICE_TRITON = "3.6.0"
SMS = KL.H200_SMS


class H200Driver:
    """Stands in for Triton's CUDA driver where there is no GPU: it names an sm_90 target and
    nothing else (a launch through it would fail: every launch here is a warm-up)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        raise RuntimeError(f"precompile's stand-in driver has no {name}: a launch reached the GPU path")


@contextlib.contextmanager
def compile_only(launched: collections.Counter):
    """Triton's launches compile (into the cache) and do not run, with the H200 stand-in driver;
    each launch counted in `launched` by kernel name."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        launched[self.__name__] += 1
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    old = driver._active  # (reading .active would create the machine's driver: none here)
    driver.set_active(H200Driver())
    JITFunction.run = warm
    try:
        yield
    finally:
        JITFunction.run = run
        driver._active = old


class _Ordering:
    """Stands in for a CUDA stream or event on the CPU: nothing runs, so nothing needs ordering."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


@contextlib.contextmanager
def gpu_shaped(dec):
    """The CPU decoder's step made to take the paths an H200 takes where they launch other Triton
    kernels: the side streams' orders (stand-in streams and events), the CUDA C++ experts and routing
    (mode "lut", route_cuda: their launches skipped) with an H200's SMs and shared memory."""
    import torch

    from megastep.kernels import cuda_module, moe_lut, route_cuda

    patches = [(torch.cuda, "current_stream", lambda device=None: _Ordering()),
               (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
               (torch.cuda, "Event", _Ordering),
               (torch.cuda, "is_current_stream_capturing", lambda: False),
               (torch.Tensor, "record_stream", lambda self, s: None),
               (cuda_module.Kernel, "launch", lambda self, *args, **kwargs: None),
               (moe_lut, "supported", lambda *args: True), (route_cuda, "supported", lambda *args: True),
               (moe_lut, "_sms", lambda index: SMS),
               (moe_lut, "_ring_fits", lambda index, nbytes: nbytes <= 227 << 10),  # an H200's CTA limit
               (dec, "side_stream", _Ordering()), (dec, "hc_stream", _Ordering()), (dec, "idx_stream", _Ordering()),
               (dec, "moe_mode", "lut"), (dec, "route_cuda_ok", True)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, v in patches:
        setattr(obj, name, v)
    try:
        yield
    finally:
        for obj, name, v in saved:
            setattr(obj, name, v)


def key() -> str:
    """A short hash of what every Triton cache key here starts with (Triton's own files, libtriton
    included) and of its ptxas's version: equal here and on the device when both run one Triton build."""
    import hashlib

    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    return hashlib.sha256((triton_key() + get_ptxas_version(90)).encode()).hexdigest()[:16]


def triton_entries(cache: str) -> set[str]:
    """The kernels compiled into a Triton cache directory (one entry per directory with a group file)."""
    if not os.path.isdir(cache):
        return set()
    return {d for d in os.listdir(cache)
            if any(f.startswith("__grp__") for f in os.listdir(os.path.join(cache, d)))}


INTERMEDIATE = (".ttir", ".ttgir", ".llir", ".source")  # (kept: metadata, cubin, and PTX, which some tools read)


def pack(out: str, root: str | None = None, cuda_src: str | None = None) -> str:
    """The caches under `root` (default CACHE_ROOT) packed into `out` (.tgz) without the Triton
    kernels' intermediate IR (a cache hit reads only their metadata and cubin), with the CUDA C++
    cubins of cuda_src (default: cuda_module's cache) and this Triton's key; a line saying what was
    packed."""
    from megastep.kernels import cuda_module

    root = root or CACHE_ROOT
    triton_dir, cuda_dir = os.path.join(root, "triton"), os.path.join(root, "cuda")
    os.makedirs(cuda_dir, exist_ok=True)
    src = cuda_module.cache_dir() if cuda_src is None else cuda_src
    if os.path.isdir(src) and os.path.realpath(src) != os.path.realpath(cuda_dir):
        for f in os.listdir(src):
            if f.endswith(".cubin"):
                shutil.copy2(os.path.join(src, f), cuda_dir)
    with open(os.path.join(root, "triton_key.txt"), "w") as f:
        f.write(key() + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        tar.add(root, arcname=os.path.basename(root), filter=lambda t: None if t.name.endswith(INTERMEDIATE) else t)
    cubins = len([f for f in os.listdir(cuda_dir) if f.endswith(".cubin")])
    return (f"packed {len(triton_entries(triton_dir))} Triton kernels and {cubins} CUDA C++ cubins into {out} "
            f"({os.path.getsize(out) / 2**20:.1f} MiB)")


def build_cubins() -> list[str]:
    """Every CUDA C++ module the step loads, built into cuda_module's cache (the cubin files)."""
    from megastep.kernels import moe_lut, route_cuda, sidecar_zero_copy

    mods = [moe_lut._MODULE, route_cuda._module(256), sidecar_zero_copy._MODULE]  # V4-Flash: 256 experts
    for m in mods:
        m.cubin()
    return [os.path.basename(m.source_path) for m in mods]


def compile_steps(dec, rows: list[int], arms: list[tuple[str, str]], context: int, cache: str,
                  log=print) -> collections.Counter:
    """Each arm's steps of `rows` rows (bench.py's rows at `context`, then StepRunner's greedy
    tokens), every Triton launch compiled into `cache` (the process's TRITON_CACHE_DIR) for an H200
    and not run; the launches by kernel name. The arms' statements are put back after each."""
    import ab_step
    import torch

    from megastep.bench import _rows
    from megastep.kernels.argmax import argmax_rows

    launched = collections.Counter()
    with compile_only(launched), gpu_shaped(dec):
        for name, code in arms:
            def steps(name=name):  # (called at once, by with_arm)
                for r in rows:
                    t, n = time.perf_counter(), len(triton_entries(cache))
                    argmax_rows(dec.step(*_rows(torch.device("cpu"), r, context, 1)))
                    log(f"  arm {name}, {r} rows: {len(triton_entries(cache)) - n} new kernels "
                        f"({time.perf_counter() - t:.1f} s)")
            ab_step.with_arm(name, code, steps, [])
    return launched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="the row counts of the steps compiled")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=STATEMENTS",
                    help="ab_step.py's arms: each one's statements in effect for a pass of steps of its own")
    ap.add_argument("--out", default=os.path.join(os.path.abspath(ROOT), "build", "device_cache.tgz"))
    ap.add_argument("--fresh", action="store_true", help="empty CACHE_ROOT first (else entries accumulate)")
    ap.add_argument("--pack", metavar="OUT", help="only pack CACHE_ROOT into OUT (a device call's caches, "
                    "h200_checks.sh's last step): compile nothing")
    args = ap.parse_args(argv)
    if args.pack:
        print(pack(args.pack))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("precompile compiles for the GPU: run it without TRITON_INTERPRET=1")
    import triton

    if triton.__version__ != DEVICE_TRITON or sys.version_info[:2] != (3, 12):
        raise SystemExit(f"the device runs Triton {DEVICE_TRITON} on Python 3.12, whose keys differ from this "
                         f"Triton {triton.__version__} on Python {sys.version.split()[0]}'s: run precompile with that "
                         "pair (e.g. a Python 3.12 venv with triton==3.6.0 and torch)")
    import ab_step

    from megastep.kernels import cuda_module

    rows = sorted({int(r) for r in args.rows.split(",")})
    arms = ab_step.parse_arms(args.arm) if args.arm else [("default", "")]
    if args.fresh:
        shutil.rmtree(CACHE_ROOT, ignore_errors=True)
    triton_dir, cuda_dir = os.path.join(CACHE_ROOT, "triton"), os.path.join(CACHE_ROOT, "cuda")
    os.environ["TRITON_CACHE_DIR"] = triton_dir  # read when the first kernel compiles
    cuda_module.cache_dir = lambda: cuda_dir
    ab_step.import_all()
    KL.gpu_launch_options(SMS)
    before = triton_entries(triton_dir)
    t0 = time.perf_counter()
    print(f"CUDA C++ modules: {', '.join(build_cubins())} ({time.perf_counter() - t0:.1f} s)", flush=True)
    # a layer of each kind the 30-layer bench has: window and CSA hash-routed, CSA, HCA, window top-k
    dec = KL.v4_flash_decoder(max(rows), args.context, compress_ratios=(0, 4, 4, 128, 0), num_hash_layers=2)
    launched = compile_steps(dec, rows, arms, args.context, triton_dir, log=lambda m: print(m, flush=True))
    after = triton_entries(triton_dir)
    print(f"Triton {triton.__version__}, sm_90: {len(after)} kernels in {triton_dir} ({len(after - before)} new, "
          f"{sum(launched.values())} launches) in {time.perf_counter() - t0:.0f} s; {pack(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
