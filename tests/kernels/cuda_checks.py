"""Checks of hand-written CUDA C++ kernels that need nvcc but no GPU (moe_lut.cu, route_cuda.cu)."""

from __future__ import annotations

import os
import re
import subprocess

from megastep.kernels.cuda_module import build_cubin, find_nvcc


def assert_builds_without_spills(source: str, kernels: tuple[str, ...], flags: tuple[str, ...] = ()) -> None:
    """`source` compiles (nvcc, sm_90, with `flags`) with the headers it includes, every kernel in
    `kernels` with no local memory: a spill would put loads in its inner loop."""
    assert build_cubin(source, extra_flags=flags)[:4] == b"\x7fELF"
    out = subprocess.run([find_nvcc(), "--cubin", "-arch=sm_90", "-O3", "-std=c++17", *flags, "-Xptxas", "-v",
                          "-o", os.devnull, source], capture_output=True, text=True, check=True)
    for kernel in kernels:
        assert f"Compiling entry function '{kernel}'" in out.stderr
    assert out.stderr.count("0 bytes spill stores, 0 bytes spill loads") == len(kernels), out.stderr
    assert out.stderr.count("0 bytes stack frame") == len(kernels), out.stderr


def assert_signature_matches(source: str, kernel) -> None:
    """The Python side passes as many arguments as `kernel` (a cuda_module.Kernel) declares in
    `source`, typed by position (p pointer, q int64, i int32, f float): a mismatch would pass
    garbage without an error."""
    src = open(source).read()
    kinds = {"p": r".*\*\s*\w+", "q": r"long long \w+", "i": r"int \w+", "f": r"float \w+"}
    head = src[src.index(f"{kernel.name}(") + len(kernel.name) + 1:]
    params = []
    for p in (p.strip() for p in head[:head.index(")")].split(",")):
        macro = re.search(rf"#define {p}((?:.*\\\n)*.*)", src) if re.fullmatch(r"[A-Z_]+", p) else None
        # a parameter list shared by kernels (a #define, its lines joined by backslashes)
        params += [q.strip() for q in macro.group(1).replace("\\\n", " ").split(",")] if macro else [p]
    assert len(params) == len(kernel.signature), kernel.name
    for p, c in zip(params, kernel.signature):
        assert re.fullmatch(kinds[c], p), (kernel.name, p, c)
