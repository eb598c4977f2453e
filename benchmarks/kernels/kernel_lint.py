"""Every Triton kernel a decode step launches, compiled for sm_90 on this CPU machine and checked for
what costs a latency-bound decode kernel dearly without showing in its source: calls to
subroutines (a 64-bit integer division or modulo is a ~100-instruction call per element; one in
attention's KV loop was found this way), register spills to local memory, its register count, and
its global loads narrower than 4 bytes (a tile loaded 2 bytes at a time: Triton 3.9 lost the KV
rows' alignment in attention's select between window and compressed rows).

    python benchmarks/kernels/kernel_lint.py [--json FILE]

Two processes: the first runs three decode steps of a tiny V4-shaped model (the kernels of every
layer kind, 6, 3 and 1 rows) under the Triton interpreter and records each launch's argument types
and constexprs; the second compiles each distinct launch for sm_90 (the installed Triton; the
device runs 3.6) and disassembles it with the cuobjdump Triton ships. Shapes are the tiny model's,
so register counts and spills are indicative only; calls do not depend on the shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
# launch options that are not constexprs of the kernel
_OPTIONS = {"num_warps", "num_stages", "launch_pdl", "enable_fp_fusion", "enable_reflect_ftz", "num_ctas"}


def _type_of(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                      torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
                      torch.float8_e4m3fn: "fp8e4nv"}[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(type(v))


H200_SMS = 132  # an H200's multiprocessors: the launch options the tools here give a step on the CPU
MODULES = ("attention", "compressor", "dense", "indexer", "linear_fp8", "mhc", "moe", "moe_route", "pair_combine",
           "rope_norm", "router")


def launch_record(module: str, name: str, kernel, grid, args: tuple, kwargs: dict) -> dict:
    """What compiling one launch needs (argument types, constexprs, options, the ints that are
    multiples of 16), and its grid (a callable grid evaluated on the launch's arguments)."""
    import inspect

    fn = getattr(kernel, "fn", kernel)
    names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
    pos = dict(zip(names, args))
    const = {k: v for k, v in kwargs.items() if k not in _OPTIONS and k != "maxnreg"}
    for p in inspect.signature(fn).parameters.values():  # constexprs left at their defaults
        if p.name not in pos and p.name not in const and p.default is not inspect.Parameter.empty:
            const[p.name] = p.default
    sig = [(n, _type_of(pos[n])) for n in names if n in pos]
    aligned = [n for n in names if isinstance(pos.get(n), int) and not isinstance(pos[n], bool) and pos[n] % 16 == 0]
    opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")}
    grid = grid({**pos, **kwargs}) if callable(grid) else grid
    grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
    return dict(module=module, kernel=name, signature=sig, constexprs=const, options=opts, aligned=aligned, grid=grid)


def compile_key(rec: dict) -> str:
    return json.dumps([rec["module"], rec["kernel"], rec["signature"], sorted(rec["constexprs"].items()),
                       sorted(rec["options"].items())], default=str)


class Recorder:
    """Stands in for a @triton.jit kernel: each launch is handed to `sink` as a launch_record, and
    not run. A step's launches and their arguments never depend on a kernel's output (the step is
    captured in a CUDA graph), so a step issues the same launches with the kernels skipped."""

    def __init__(self, module: str, name: str, kernel, sink):
        self.module, self.name, self.kernel, self.sink = module, name, kernel, sink

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.sink(launch_record(self.module, self.name, self.kernel, grid, args, kwargs))
        return run


def install_recorders(sink) -> None:
    """Every `*_kernel` of the step's kernel modules replaced by a Recorder feeding `sink`."""
    import importlib

    for mod in MODULES:
        m = importlib.import_module(f"megastep.kernels.{mod}")
        for name, obj in list(vars(m).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__") and hasattr(obj, "fn"):
                setattr(m, name, Recorder(mod, name, obj, sink))


def gpu_launch_options(sms: int = H200_SMS) -> None:
    """Make a step on CPU tensors take an H200's launch options: every kernel module's interpreter check
    (which turns off PDL and register caps and picks the interpreter's fp32 paths) answers no, and
    the SM count is the H200's."""
    import importlib
    import pkgutil

    import megastep.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        m = importlib.import_module(f"megastep.kernels.{info.name}")
        if hasattr(m, "on_interpreter"):
            m.on_interpreter = lambda t: False
        if hasattr(m, "sm_count"):  # (common's, and the modules that import it by name)
            m.sm_count = lambda device: sms


def v4_flash_decoder(max_rows: int, context: int, compress_ratios=(0, 4, 128), num_hash_layers: int = 1):
    """A FastDecoder of V4-Flash width on the CPU, one layer per entry of compress_ratios (the first
    num_hash_layers hash-routed), weights uninitialized (no kernel runs: a step's launches are
    recorded or compiled; the decoder's own repacking still touches ~3.5 GB a layer: 18 GB for
    precompile.py's 5 layers), the bench's pools (context + 128 positions: the attention's entry
    counts, so its pinned plans)."""
    import dataclasses

    import torch

    from megastep.checkpoint.synthetic import preset
    from megastep.checkpoint.tensors import expected_tensors
    from megastep.model.fast import FastDecoder

    cfg = dataclasses.replace(preset("v4-flash", layers=len(compress_ratios)), compress_ratios=tuple(compress_ratios),
                              num_hash_layers=num_hash_layers)
    weights = {n: torch.empty(s.shape, dtype=s.dtype) for n, s in expected_tensors(cfg, include_mtp=False).items()}
    return FastDecoder(cfg, weights, max_seqs=max_rows, max_ctx=context + 128, device="cpu", triton=True,
                       consume=True)


def record() -> list[dict]:
    """Run the decode steps under the interpreter, the kernels' launches recorded and skipped; one
    record per distinct (kernel, signature, constexprs)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    import torch

    from megastep.checkpoint.synthetic import synthesize_weights
    from megastep.model.fast import FastDecoder
    from test_fast_step_triton import tiny_cfg

    seen: dict[str, dict] = {}
    install_recorders(lambda rec: seen.setdefault(compile_key(rec), rec))  # the same 35 records in 2 s, not 30
    cfg = tiny_cfg(o_lora_rank=128)
    w = synthesize_weights(cfg, seed=2, device="cpu", include_mtp=False)
    dec = FastDecoder(cfg, w, max_seqs=6, max_ctx=64, device="cpu", triton=True)
    for s in range(6):
        dec.pools.reset(s)
    ids = torch.randint(0, cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    for t, rows in enumerate((6, 3, 1)):  # 6 rows (the router's launch without the gate), 3, then 1
        dec.step(ids[t, :rows], torch.full((rows,), t), torch.arange(rows))
    return list(seen.values())


def compile_record(r: dict):
    """The launch compiled for sm_90 with the installed Triton (no interpreter): (kernel, SASS,
    cuobjdump's resource usage)."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import importlib

    import sass_loop as SL

    fn = getattr(importlib.import_module(f"megastep.kernels.{r['module']}"), r["kernel"])
    const = dict(r["constexprs"])
    if "INTERPRET" in const:
        const["INTERPRET"] = False
    aligned = set(r.get("aligned", []))  # ints that were multiples of 16 (Triton's launcher specializes them)
    opts = r["options"]
    extra = {k: opts[k] for k in ("enable_fp_fusion", "maxnreg") if k in opts}
    k = SL._compile(fn, [tuple(a) for a in r["signature"]], const, aligned, opts.get("num_warps", 4),
                    opts.get("num_stages", 3), **extra)
    return k, SL.cuobjdump(k, "-sass"), SL.cuobjdump(k, "-res-usage")


def calls(sass: str) -> dict:
    """The kernel's subroutine calls: all of them, those inside a loop (between a backward branch
    and its target), and those whose target converts to or from 64-bit integers in its first 16
    instructions (a 64-bit division or modulo; a float division's or square root's rare slow
    path does not)."""
    sys.path.insert(0, HERE)
    import sass_loop as SL

    ins = SL.instructions(sass)
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = SL.loops(ins)
    n = in_loop = int64 = 0
    for i, (_, text) in enumerate(ins):
        m = re.search(r"\bCALL\.\S+ (?:\S+ )?(0x[0-9a-f]+)", text)
        if not m:
            continue
        n += 1
        in_loop += any(s <= i <= e for s, e in loops)
        j = at.get(int(m.group(1), 16))
        if j is not None and any(re.search(r"[FI]2[IF]\.(?:U|S)?64|I2F\.U64|F2I\.U64", t) for _, t in ins[j:j + 16]):
            int64 += 1
    return dict(calls=n, calls_in_loops=in_loop, int64_division_calls=int64)


def lint(recs: list[dict]) -> list[dict]:
    """Compile each record for sm_90 and count calls, spills and registers (no interpreter)."""
    out = []
    for r in recs:
        try:
            _, sass, res = compile_record(r)
            regs = re.search(r"REG:(\d+)", res)
            stack = re.search(r"STACK:(\d+)", res)
            out.append(dict(kernel=f"{r['module']}.{r['kernel']}", **calls(sass),
                            spill_stores=len(re.findall(r"\bSTL\b", sass)),
                            narrow_loads=len(re.findall(r"\bLDG\.E(?:\.EL|\.EF|\.LU)?\.[US](?:8|16)\b", sass)),
                            loads=len(re.findall(r"\bLDG\b", sass)), registers=int(regs.group(1)) if regs else None,
                            stack=int(stack.group(1)) if stack else None,
                            instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
                            constexprs={k: v for k, v in r["constexprs"].items() if k.isupper()}))
        except Exception as e:  # noqa: BLE001  (report and go on)
            out.append(dict(kernel=f"{r['module']}.{r['kernel']}", error=f"{type(e).__name__}: {e}"[:300]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record_only:
        print(json.dumps(record(), default=str))
        return
    if args.records:
        recs = json.load(open(args.records))
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, __file__, "--record-only"], env=env, capture_output=True, text=True,
                              timeout=1200)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        recs = json.loads(done.stdout.strip().splitlines()[-1])
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_lint compiles for the GPU: run it without TRITON_INTERPRET=1")
    rows = lint(recs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'kernel':42} {'calls':>5} {'loop':>4} {'i64/':>4} {'STL':>4} {'regs':>4} {'stack':>5} {'instr':>6} "
          f"{'LDG':>5} {'<4B':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:42} error: {r['error']}")
        else:
            print(f"{r['kernel']:42} {r['calls']:5} {r['calls_in_loops']:4} {r['int64_division_calls']:4} "
                  f"{r['spill_stores']:4} {r['registers']:4} {r['stack']:5} {r['instructions']:6} {r['loads']:5} "
                  f"{r['narrow_loads']:5}")


if __name__ == "__main__":
    main()
