"""GPU check and timing of the fused decode kernels at V4-Flash shapes, in one run.

    python benchmarks/kernels/bench_kernels.py [--sweep] [--out DIR] [--only linear|moe]

1. Measures the device's streaming-read bandwidth (a Triton read kernel over 4 GiB) and the
   device-to-device copy rate: the roofline for memory-bound kernels.
2. linear_fp8 at M = 1, 4, 16, 64 on wq_a, wq_b, wkv, wo_b, shared w1, shared w2; moe at
   E 256, D 4096, I 2048, k 6 with random routing. Each configuration is first checked against
   its *_ref (tolerances of tests/kernels) and for determinism (5 runs, identical bits).
3. Timing: a CUDA graph of back-to-back calls, each on a different copy of the weights (or a
   different routing), so that nothing is served from the 60 MB L2; median of 20 replays / calls.
   GB/s counts the bytes that must be read (weights + scales + activations).
With --sweep every case also times a few candidate configurations and reports the best.
Prints a short table last; full log and JSON under --out (default $OUT or out/bench).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import subprocess
from dataclasses import asdict

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megastep.kernels import linear_fp8 as LIN  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402
from megastep.kernels.common import next_pow2  # noqa: E402

LINEAR_SHAPES = {  # name: (N, K)
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wkv": (512, 4096),
    "wo_b": (4096, 8192),
    "sh_w1": (2048, 4096),
    "sh_w2": (4096, 2048),
}
MS = (1, 4, 16, 64)
MOE_SHAPE = dict(E=256, D=4096, I=2048, k=6)
L2_FLUSH_BYTES = 200 << 20  # bytes touched per graph, > 3x the 60 MB L2

LOG = None
DEV = "cuda"  # --smoke: "cpu" under the Triton interpreter, tiny shapes (checks this script itself)


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    if LOG:
        LOG.write(s + "\n")
        LOG.flush()


# ---- roofline ---------------------------------------------------------------------------------
@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(v, axis=0))


def events_time(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)  # µs


def measure_bandwidth():
    if DEV == "cpu":
        return {"read": 1.0, "copy_rw": 1.0}
    n = (4 << 30) // 4
    x = torch.empty(n, dtype=torch.float32, device=DEV).uniform_(-1, 1)
    res = {}
    for block in (4096, 8192):
        out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=DEV)
        us = events_time(lambda: _read_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=8))
        res[f"read_{block}"] = 4 * n / us / 1e3
    half = n // 2
    y = torch.empty(half, dtype=torch.float32, device=DEV)
    us = events_time(lambda: y.copy_(x[:half]))
    res["copy_rw"] = 2 * 4 * half / us / 1e3
    res["read"] = max(v for k, v in res.items() if k.startswith("read_"))
    x = y = None  # (the 6 GiB back to the allocator; `del` would leave the lambdas' names undefined to ruff)
    torch.cuda.empty_cache()
    return res  # GB/s


PARTIAL = {}


def save_partial(results):
    """bench.json after every case, so that a run stopped at its time limit still leaves data."""
    if PARTIAL:
        with open(PARTIAL["path"], "w") as f:
            json.dump(dict(device=PARTIAL["device"], bandwidth=PARTIAL["bw"], results=results), f, indent=1)


def write_results(path: str | None, results: list) -> None:
    """{"device", "results"} as JSON at path (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


def graph_time(calls, reps=20):
    """calls: list of zero-arg callables (one kernel call each). µs per call, graph-replayed."""
    for c in calls:
        c()
    if DEV == "cpu":
        t0 = time.perf_counter()
        for c in calls:
            c()
        us = (time.perf_counter() - t0) * 1e6 / len(calls)
        return us, us
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(ts), min(ts)


# ---- correctness (the tolerances of tests/kernels) ---------------------------------------------
def start_workers(script: str, payload: dict, n_jobs: int, shards: int, extra: tuple[str, ...] = ()):
    """Compile workers for a tuning sweep: writes `payload` to a job file and starts `shards`
    processes `script --warm FILE --shard i --shards n [extra]` that fill Triton's disk cache
    while the parent builds its inputs. Returns the handle for finish_workers."""
    fd, path = tempfile.mkstemp(prefix="tune_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    shards = max(1, min(shards, n_jobs))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), "--warm", path, "--shard", str(i),
                               "--shards", str(shards), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(shards)]
    return path, procs, n_jobs, time.time()


def add_worker_arguments(ap: argparse.ArgumentParser) -> None:
    """A tuner's compile-worker options (start_workers runs the script with them)."""
    ap.add_argument("--shards", type=int, default=None, help="compile processes (default: CPUs - 1, at most 16)")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # compile worker: job file
    ap.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)


def finish_workers(handle, log) -> None:
    """Waits for the compile workers, logs their errors, removes the job file."""
    path, procs, n, t0 = handle
    for p in procs:
        out, _ = p.communicate()
        for line in out.splitlines():
            if "error" in line.lower() or "Traceback" in line:
                log("  " + line[:600])
        if p.returncode:
            log(f"  compile process exited with {p.returncode}: {out[-600:]}")
    os.unlink(path)
    log(f"compiled {n} configurations in {len(procs)} processes: {time.time() - t0:.1f} s")


def tuner_device(smoke: bool) -> str:
    """A tuner's device: "cpu" under the interpreter for --smoke (the process re-executes itself
    with TRITON_INTERPRET=1 so the kernels are decorated in that mode), else "cuda" (printed)."""
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(sys.executable, [sys.executable] + sys.argv)
        return "cpu"
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name} sms={p.multi_processor_count} torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    return "cuda"


def write_tune_json(path: str, smoke: bool, table: list, winners: dict) -> None:
    """A tuner's table and winners as JSON."""
    with open(path, "w") as f:
        json.dump(dict(device="cpu (smoke)" if smoke else torch.cuda.get_device_name(0), torch=torch.__version__,
                       rows=table, winners=[dict(key=list(k), cfg=asdict(c)) for k, c in winners.items()]),
                  f, indent=1, default=str)
    print(f"wrote {path}")


def run_tuner(args: argparse.Namespace, smoke: bool, smoke_settings, warm_worker, sweep, install, pick_config):
    """The main flow of a tuning script (tune_attention, tune_mhc): a compile worker fills the
    cache and returns None; otherwise `sweep(device, table)` measures, `install` pins the winners
    in this process (pick_config must then return them) and --json writes the table. `smoke`:
    tiny shapes on the CPU through the interpreter. Returns the winners."""
    if smoke:
        tuner_device(smoke=True)
        smoke_settings()
        torch.set_num_threads(1)
    if args.warm:
        warm_worker(args.warm, args.shard, args.shards)
        return None
    device = tuner_device(args.smoke)
    table = []
    winners = sweep(device, table)
    install(winners)
    assert all(pick_config(*key) == cfg for key, cfg in winners.items())
    if args.json:
        write_tune_json(args.json, args.smoke, table, winners)
    return winners


def check_linear(y, ref):
    y, ref = y.float(), ref.float()
    tol = 2.0**-7 * ref.abs() + 1e-5 * ref.abs().max()  # one bf16 step (tests/kernels/test_linear_fp8.py)
    bad = int(((y - ref).abs() > tol).sum())
    rel = ((y - ref).norm() / ref.norm()).item()
    return bad == 0 and bool(torch.isfinite(y).all()), f"bad={bad} maxerr={(y - ref).abs().max().item():.3g} rel={rel:.2e}"


def check_swiglu(y, x, w13, s, limit):
    """y = swiglu(x @ w1^T, x @ w3^T) in bf16 against the bound that g and u each one bf16 step off the exact
    ref's allow (tests/kernels/test_linear_fp8.py's check_swiglu: |silu'| <= 1.1, the clamps 1-Lipschitz), plus
    the output's own rounding. The plain linear tolerance is too tight here: silu(g) u amplifies g's step."""
    I = w13.shape[0] // 2
    g, u = (LIN.linear_fp8_ref(x, w, sc).float() for w, sc in ((w13[:I], s[:I // 128]), (w13[I:], s[I // 128:])))
    step = 2.0**-7
    dg, du = step * g.abs() + 1e-5 * g.abs().max(), step * u.abs() + 1e-5 * u.abs().max()
    if limit > 0:  # what is left of each step after the clamp (none where g +- dg lies past the limit)
        def clamped(t, d, lo):
            c = t.clamp(lo, limit)
            return c, torch.maximum((t + d).clamp(lo, limit) - c, c - (t - d).clamp(lo, limit))
        (g, dg), (u, du) = clamped(g, dg, None), clamped(u, du, -limit)
    silu = torch.nn.functional.silu(g)
    ref = (silu * u).to(torch.bfloat16).float()
    tol = 1.01 * ((silu.abs() + 1.1 * dg) * du + u.abs() * 1.1 * dg) + step * ref.abs() + 1e-6 * ref.abs().max()
    err = (y.float() - ref).abs()
    bad = int((err > tol).sum())
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    return bad == 0 and bool(torch.isfinite(y).all()), f"bad={bad} maxerr={err.max().item():.3g} rel={rel:.2e}"


def check_moe(y, ref):
    rel = ((y - ref).norm() / ref.norm()).item()
    mx = (y - ref).abs().max().item() / ref.abs().max().item()
    return rel <= 4e-3 and mx <= 2e-2 and bool(torch.isfinite(y).all()), f"rel={rel:.2e} max/maxref={mx:.2e}"


# ---- linear_fp8 -----------------------------------------------------------------------------------
def fp8_weight(N, K, g, device=None):
    device = device or DEV
    w = (torch.randn(N, K, device=device, generator=g) * 64).to(torch.float8_e4m3fn)
    s = torch.randint(118, 125, (triton.cdiv(N, 128), triton.cdiv(K, 128)), device=device, generator=g,
                      dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def auto_split(tiles, K, bk, target):
    kb = triton.cdiv(K, 128)
    s = 1
    while tiles * s * 2 <= target and (kb // (s * 2)) * 128 >= bk:
        s *= 2
    return s


def linear_candidates(M, N, K, sweep):
    picked = LIN.pick_config(M, N, K)
    if not sweep:
        return picked, [picked]
    C = LIN.LinearFp8Config
    out = [picked]
    if sweep == "lite":  # one alternative: a K step of 256
        bm = 16 if M <= 16 else next_pow2(M)
        split = triton.cdiv(K, 256) if M <= 16 else auto_split(triton.cdiv(N, 64), K, 256, 264)
        alt = C("dot16", 64, bm, 256, split, 4, 3)
        return picked, [picked] + ([alt] if alt != picked else [])
    if M <= 16:
        for bn, bk, nw, ns, target in [(64, 256, 4, 3, 264), (64, 128, 4, 3, 264), (128, 128, 8, 4, 264), (64, 256, 4, 4, 528)]:
            out.append(C("dot16", bn, 16, bk, auto_split(triton.cdiv(N, bn), K, bk, target), nw, ns))
    else:
        bm = next_pow2(M)
        for bn, bk, nw, ns, target in [(64, 256, 4, 3, 264), (128, 128, 8, 4, 264), (64, 128, 4, 4, 528)]:
            out.append(C("dot16", bn, bm, bk, auto_split(triton.cdiv(N, bn), K, bk, target), nw, ns))
    return picked, list(dict.fromkeys(out))  # distinct, in order


def bench_linear(sweep, results):
    g = torch.Generator(device=DEV).manual_seed(0)
    weights = {}
    for name, (N, K) in LINEAR_SHAPES.items():
        nbytes = N * K + triton.cdiv(N, 128) * triton.cdiv(K, 128)
        copies = max(1, min(128, math.ceil(L2_FLUSH_BYTES / nbytes)))
        weights[name] = [fp8_weight(N, K, g) for _ in range(copies)]
    for name, (N, K) in LINEAR_SHAPES.items():
        ws = weights[name]
        for M in MS:
            picked, cands = linear_candidates(M, N, K, sweep)
            x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
            ref = LIN.linear_fp8_ref(x, *ws[0])
            nbytes = N * K + triton.cdiv(N, 128) * triton.cdiv(K, 128) + M * K * 2
            rows = []
            for c in cands:
                r = dict(kernel="linear_fp8", shape=name, N=N, K=K, M=M, config=asdict(c), picked=c == picked)
                try:
                    y = LIN.linear_fp8(x, *ws[0], config=c)
                    ok, msg = check_linear(y, ref)
                    same = all(torch.equal(y.view(torch.int16), LIN.linear_fp8(x, *ws[0], config=c).view(torch.int16)) for _ in range(5))
                    med, best = graph_time([lambda w=w, s=s, c=c: LIN.linear_fp8(x, w, s, config=c) for (w, s) in ws])
                    r.update(ok=ok, check=msg, deterministic=same, us=med, us_min=best, gbps=nbytes / med / 1e3)
                except Exception as e:  # noqa: BLE001
                    r.update(ok=False, error=repr(e)[:500])
                    log(traceback.format_exc()[-1500:])
                rows.append(r)
                log(json.dumps(r))
                save_partial(results + rows)
            results.extend(rows)
    del weights
    torch.cuda.empty_cache()


# ---- moe ------------------------------------------------------------------------------------------
def moe_candidates(M, sweep):
    E, D, I, k = (MOE_SHAPE[n] for n in ("E", "D", "I", "k"))
    picked = MOE.pick_config(M, k, E, D, I)
    if not sweep:
        return picked, [picked]
    C = MOE.MoeConfig
    S = min(M * k, E)

    def grp(bi, bd, per_sm):
        return max(1, min(S, per_sm * 132 // triton.cdiv(I, bi))), max(1, min(S, per_sm * 132 // triton.cdiv(D, bd)))

    out = [picked]
    for bi, bd, bk, nw, per_sm in [(32, 64, 128, 4, 4), (16, 32, 128, 4, 16), (16, 32, 256, 8, 8)]:
        out.append(C(bi, bd, 1, bk, *grp(bi, bd, per_sm), num_warps=nw))
    return picked, list(dict.fromkeys(out))  # distinct, in order


def bench_moe(sweep, results):
    E, D, I, k = (MOE_SHAPE[n] for n in ("E", "D", "I", "k"))
    g = torch.Generator(device=DEV).manual_seed(1)
    ex = {
        "w13": torch.randint(-128, 128, (E, 2 * I, D // 2), generator=g, device=DEV, dtype=torch.int8),
        "w13_scale": torch.randint(118, 124, (E, 2 * I, D // 32), generator=g, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "w2": torch.randint(-128, 128, (E, D, I // 2), generator=g, device=DEV, dtype=torch.int8),
        "w2_scale": torch.randint(118, 124, (E, D, I // 32), generator=g, device=DEV, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }
    per_expert = 2 * I * D // 2 + 2 * I * D // 32 + D * I // 2 + D * I // 32
    n_routings = 8
    for M in MS:
        picked, cands = moe_candidates(M, sweep)
        x = torch.randn(M, D, device=DEV, generator=g).bfloat16()
        routings = []
        for _ in range(n_routings):
            ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(M)]).to(torch.int32)
            wts = torch.rand(M, k, device=DEV, generator=g) + 0.1
            routings.append((ids, wts))
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in routings)
        nbytes = distinct * per_expert + M * D * 2
        ref = MOE.moe_experts_mxfp4_ref(x, *routings[0], **ex)
        for c in cands:
            r = dict(kernel="moe_mxfp4", shape=f"E{E}xD{D}xI{I}k{k}", M=M, distinct_experts=distinct, config=asdict(c), picked=c == picked)
            try:
                y = MOE.moe_experts_mxfp4(x, *routings[0], **ex, config=c)
                ok, msg = check_moe(y, ref)
                same = all(torch.equal(y, MOE.moe_experts_mxfp4(x, *routings[0], **ex, config=c)) for _ in range(5))
                med, best = graph_time([lambda ids=ids, wts=wts, c=c: MOE.moe_experts_mxfp4(x, ids, wts, **ex, config=c) for ids, wts in routings])
                r.update(ok=ok, check=msg, deterministic=same, us=med, us_min=best, gbps=nbytes / med / 1e3)
            except Exception as e:  # noqa: BLE001
                r.update(ok=False, error=repr(e)[:500])
                log(traceback.format_exc()[-1500:])
            results.append(r)
            log(json.dumps(r))
            save_partial(results)
        # the routing kernel alone
        try:
            med, _ = graph_time([lambda ids=ids: MOE.moe_route(ids, E, x) for ids, _ in routings])
            log(f"moe_route (+ x quant) M={M}: {med:.2f} us")
            results.append(dict(kernel="moe_route", M=M, us=med))
        except Exception as e:  # noqa: BLE001
            log("moe_route failed", repr(e)[:300])


# ---- parallel compilation: subprocesses fill Triton's on-disk cache -------------------------------
def warm_jobs(sweep, only):
    jobs = []
    if only in (None, "linear"):
        for name, (N, K) in LINEAR_SHAPES.items():
            for M in MS:
                jobs += [("linear", name, M, c) for c in linear_candidates(M, N, K, sweep)[1]]
    if only in (None, "moe"):
        for M in MS:
            jobs += [("moe", "moe", M, c) for c in moe_candidates(M, sweep)[1]]
    return jobs


def warm_shard(sweep, only, shard, shards):
    """Compile (by running once on small data) every shard-th job; errors are reported later."""
    g = torch.Generator(device=DEV).manual_seed(0)
    E, D, I, k = (MOE_SHAPE[n] for n in ("E", "D", "I", "k"))  # same sizes: same specializations
    ex = None
    for i, (kind, name, M, c) in enumerate(warm_jobs(sweep, only)):
        if i % shards != shard:
            continue
        try:
            if kind == "linear":
                N, K = LINEAR_SHAPES[name]
                LIN.linear_fp8(torch.randn(M, K, device=DEV).bfloat16(), *fp8_weight(N, K, g), config=c)
            else:
                if ex is None:
                    ex = {
                        "w13": torch.randint(-128, 128, (E, 2 * I, D // 2), device=DEV, dtype=torch.int8),
                        "w13_scale": torch.full((E, 2 * I, D // 32), 120, device=DEV, dtype=torch.uint8),
                        "w2": torch.randint(-128, 128, (E, D, I // 2), device=DEV, dtype=torch.int8),
                        "w2_scale": torch.full((E, D, I // 32), 120, device=DEV, dtype=torch.uint8),
                    }
                ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(M)]).to(torch.int32)
                MOE.moe_experts_mxfp4(torch.randn(M, D, device=DEV).bfloat16(), ids, torch.rand(M, k, device=DEV), **ex, config=c)
                MOE.moe_route(ids, MOE_SHAPE["E"], torch.randn(M, D, device=DEV).bfloat16())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"warm error {kind} {name} M={M} {c}: {e!r}"[:400], flush=True)


def parallel_warm(args, shards=8):
    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--warm-shard", "0", "--warm-shards", str(shards), "--out", args.out]
    if args.sweep:
        cmd.append("--sweep" if args.sweep == "full" else "--lite")
    if args.only:
        cmd += ["--only", args.only]
    procs = []
    for i in range(shards):
        c = list(cmd)
        c[3] = str(i)
        procs.append(subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate()
        for line in out.splitlines():
            if "error" in line.lower():
                log("  " + line[:400])
    log(f"compiled {len(warm_jobs(args.sweep, args.only))} cases in {shards} processes: {time.time() - t0:.1f}s")


def short(c):
    if c["kernel"] == "linear_fp8" or "block_n" in c["config"]:
        k = c["config"]
        return f"{k['mode']} n{k['block_n']} m{k['block_m']} k{k['block_k']} s{k['split_k']} w{k['num_warps']}/{k['num_stages']}"
    k = c["config"]
    return f"i{k['block_i']} d{k['block_d']} p{k['block_p']} k{k['block_k']} g{k['groups_up']}/{k['groups_down']} w{k['num_warps']}"


def log_compiled():
    """Registers, spills and shared memory of every compiled variant (best effort)."""
    for fn in (LIN._linear_fp8_kernel, MOE._moe_prep_kernel, MOE._moe_gate_up_kernel, MOE._moe_act_quant_kernel, MOE._moe_down_kernel):
        try:
            for caches in fn.device_caches.values():
                for key, k in caches[0].items():
                    k._init_handles()
                    consts = {n: v for n, v in getattr(k.src, "constants", {}).items() if isinstance(v, (int, bool))}
                    log(f"compiled {fn.__name__} regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} "
                        f"warps={k.metadata.num_warps} stages={k.metadata.num_stages} {str(consts)[:300] or str(key)[:300]}")
        except Exception as e:  # noqa: BLE001
            log(f"compiled-kernel info unavailable for {getattr(fn, '__name__', fn)}: {e!r}"[:300])


def smoke_setup():
    global DEV, LINEAR_SHAPES, MS, MOE_SHAPE, L2_FLUSH_BYTES
    if os.environ.get("TRITON_INTERPRET") != "1":  # the kernels must be decorated in interpreter mode
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    DEV = "cpu"
    LINEAR_SHAPES = {"a": (96, 512), "b": (130, 256)}
    MS = (1, 17)
    MOE_SHAPE = dict(E=8, D=256, I=128, k=3)
    L2_FLUSH_BYTES = 1


def main():
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_const", const="full", default=None)
    ap.add_argument("--lite", dest="sweep", action="store_const", const="lite", help="picked + one alternative")
    ap.add_argument("--only", choices=["linear", "moe"])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    ap.add_argument("--warm-shard", type=int, default=-1)
    ap.add_argument("--warm-shards", type=int, default=8)
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    ap.add_argument("--table", help="print the table of an earlier run's bench.json and exit")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            d = json.load(f)
        print_table(d["bandwidth"], d["results"])
        return
    if args.warm_shard >= 0:
        warm_shard(args.sweep, args.only, args.warm_shard, args.warm_shards)
        return
    os.makedirs(args.out, exist_ok=True)
    LOG = open(os.path.join(args.out, "bench_log.txt"), "w")
    if args.smoke:
        smoke_setup()
        name = "cpu (Triton interpreter, smoke)"
    else:
        p = torch.cuda.get_device_properties(0)
        name = p.name
        log(f"device {p.name} sms={p.multi_processor_count} torch {torch.__version__} triton {triton.__version__}")
    if not args.no_warm and not args.smoke:
        parallel_warm(args, args.warm_shards)
    bw = measure_bandwidth()
    log("bandwidth GB/s", json.dumps({k: round(v) for k, v in bw.items()}))
    PARTIAL.update(path=os.path.join(args.out, "bench.json"), device=name, bw=bw)
    results = []
    if args.only in (None, "linear"):
        bench_linear(args.sweep, results)
    if args.only in (None, "moe"):
        bench_moe(args.sweep, results)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(device=name, bandwidth=bw, results=results), f, indent=1)

    log_compiled()
    print_table(bw, results)


def print_table(bw, results):
    read_bw = bw["read"]
    log("")
    log(f"roofline: streaming read {read_bw:.0f} GB/s (copy {bw['copy_rw']:.0f} GB/s r+w)")
    log(f"{'kernel':10} {'shape':16} {'M':>3} {'us':>8} {'GB/s':>7} {'%bw':>5} ok det | picked config  || best: us  config")
    groups = {}
    for r in results:
        if r["kernel"] == "moe_route":
            continue
        groups.setdefault((r["kernel"], r["shape"], r["M"]), []).append(r)
    for (kern, shape, M), rs in groups.items():
        good = [r for r in rs if r.get("ok") and r.get("deterministic") and "us" in r]
        pk = next((r for r in rs if r["picked"]), rs[0])
        best = min(good, key=lambda r: r["us"]) if good else None
        if "us" in pk:
            line = (f"{kern[:10]:10} {shape:16} {M:3d} {pk['us']:8.2f} {pk['gbps']:7.0f} {100 * pk['gbps'] / read_bw:5.1f} "
                    f"{'Y' if pk.get('ok') else 'N'}  {'Y' if pk.get('deterministic') else 'N'}  | {short(pk)}")
        else:
            line = f"{kern[:10]:10} {shape:16} {M:3d}  FAILED {pk.get('error', '')[:80]}"
        if best is not None and best is not pk:
            line += f" || {best['us']:.2f} {100 * best['gbps'] / read_bw:.0f}% {short(best)}"
        log(line)
    for r in results:
        if r["kernel"] == "moe_route":
            log(f"moe_route M={r['M']}: {r['us']:.2f} us")


if __name__ == "__main__":
    main()
