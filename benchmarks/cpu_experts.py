"""CPU sidecar expert kernel (issue 4, Recipe B): GB/s of MXFP4 bytes streamed for one V4-Flash
expert (D 4096, I 2048: 12.58 MB of e2m1 bytes + 0.79 MB of E8M0 scales = 13.37 MB) at M rows,
next to torch baselines and the machine's measured memory read bandwidth.

Weights are cold: calls rotate over a pool of distinct experts several times the size of the last
level cache, as cold experts are in Recipe B (each read once per step). The time includes the
Python wrapper (~20 us per call).

    python benchmarks/cpu_experts.py                      # M = 1, 2, 6; 1 and 2 threads
    python benchmarks/cpu_experts.py --threads 1 2 4 8 16 --json out.json
    python benchmarks/cpu_experts.py --sporadic --threads 1 2   # one expert at a time, as Recipe B calls it
    python benchmarks/cpu_experts.py --pool 1 --rows 1 6    # one expert again and again: from the caches, compute alone

--sporadic times single one-row calls the way the sidecar makes them in a step (one cold expert now
and then, the team's threads idle in between: --gap-us apart) instead of back to back, each alone
and with --busy processes spinning beside the team (what the thread that replays the GPU's graphs
does while it waits for the step): the per-call p50 / p90 / max, to see whether a busy core stalls
the team's barriers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from megastep.cpu import experts as ce

D, I = 4096, 2048


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_pool(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """n random V4-shape experts, stacked (random e2m1 codes, E8M0 scales 2^-11..2^-4)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w13": torch.randint(-128, 128, (n, 2 * I, D // 2), dtype=torch.int8, generator=g),
        "w13_scale": torch.randint(116, 124, (n, 2 * I, D // 32), dtype=torch.uint8, generator=g),
        "w2": torch.randint(-128, 128, (n, D, I // 2), dtype=torch.int8, generator=g),
        "w2_scale": torch.randint(116, 124, (n, D, I // 32), dtype=torch.uint8, generator=g),
    }


def expert_bytes(pool: dict[str, torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in pool.values())


def timed(fn, calls: int, reps: int) -> float:
    """Median over reps of the mean seconds per call (each rep runs `calls` calls)."""
    fn(0)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def mem_read_bw(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of torch.sum over a float32 tensor far larger than the caches (best of reps)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.ones(int(gib * 2**30) // 4)
    a.sum()
    best = min(_once(lambda: a.sum()) for _ in range(reps))
    torch.set_num_threads(prev)
    return a.numel() * 4 / best / 1e9


def numpy_read_bw(gib: float = 1.0, reps: int = 5) -> float:
    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    a.sum()
    best = min(_once(lambda: a.sum()) for _ in range(reps))
    return a.nbytes / best / 1e9


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def sporadic(pool: dict[str, torch.Tensor], threads: list[int], calls: int, gap_us: float, busy: int) -> list[dict]:
    """One-row single-expert calls `gap_us` apart, per thread count, without and with `busy` spinning
    processes: p50 / p90 / max us per call."""
    import multiprocessing as mp

    x = (torch.randn(1, D) * 2).bfloat16()
    w = torch.ones(1, 1)
    ids = torch.zeros(1, 1, dtype=torch.int32)
    E = pool["w13"].shape[0]
    rows = []
    for spinning in (0, busy):
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(spinning)]
        for p in procs:
            p.start()
        time.sleep(0.3)
        try:
            for t in threads:
                us = []
                for i in range(calls + 5):
                    ids[0, 0] = i % E
                    t0 = time.perf_counter()
                    ce.experts_forward(x, ids, w, **pool, num_threads=t)
                    if i >= 5:  # (the first calls warm the team up)
                        us.append((time.perf_counter() - t0) * 1e6)
                    end = time.perf_counter() + gap_us * 1e-6
                    while time.perf_counter() < end:
                        pass
                us.sort()
                row = {"threads": t, "busy": spinning, "p50_us": statistics.median(us),
                       "p90_us": us[int(0.9 * (len(us) - 1))], "max_us": us[-1]}
                rows.append(row)
                print(f"| {t} | {spinning} | {row['p50_us']:.0f} | {row['p90_us']:.0f} | {row['max_us']:.0f} |", flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6], help="M values")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--isa", nargs="+", default=None, help="ISA paths to time (default: all this CPU runs)")
    ap.add_argument("--pool", type=int, default=24, help="distinct experts the calls rotate over (24: 321 MB)")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) torch baselines")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sporadic", action="store_true", help="only the sporadic one-expert calls (module doc)")
    ap.add_argument("--gap-us", type=float, default=200.0, help="--sporadic: between calls")
    ap.add_argument("--busy", type=int, default=1, help="--sporadic: spinning processes beside the team")
    a = ap.parse_args()
    if a.sporadic:
        pool = make_pool(a.pool)
        print(f"# CPU: {cpu_name()}; backend {ce.backend()}; one-row calls of one expert of {a.pool}, {a.gap_us:.0f} us apart")
        print("| threads | busy processes | p50 us | p90 us | max us |\n|---|---|---|---|---|")
        rows = sporadic(pool, a.threads, a.calls * 10, a.gap_us, a.busy)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"cpu": cpu_name(), "gap_us": a.gap_us, "sporadic": rows}, f, indent=1)
        return

    print(f"# CPU: {cpu_name()}, {torch.get_num_threads()} torch threads by default; torch {torch.__version__}")
    print(f"# backend: {ce.backend()}; ISA paths here: {ce.available_isas()}")
    pool = make_pool(a.pool)
    nb = expert_bytes(pool)
    print(f"# one expert: {nb / 1e6:.2f} MB of MXFP4 bytes (weights + scales); pool {a.pool} experts = {a.pool * nb / 1e6:.0f} MB")
    res: dict = {"cpu": cpu_name(), "torch": torch.__version__, "expert_bytes": nb, "pool": a.pool, "mem": {}, "rows": []}

    for t in sorted(set(a.threads)):
        res["mem"][f"torch_sum_{t}t"] = mem_read_bw(t)
    res["mem"]["numpy_sum_1t"] = numpy_read_bw()
    print("# memory read bandwidth (1 GiB float32 sum): " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in res["mem"].items()))

    isas = a.isa or ce.available_isas()
    print("\n| M | path | threads | us / expert | GB/s | % of torch.sum GB/s |")
    print("|---|---|---|---|---|---|")
    for M in a.rows:
        x = (torch.randn(M, D) * 2).bfloat16()
        r = torch.rand(M) + 0.1
        for isa in isas:
            for t in a.threads:
                def call(i, isa=isa, t=t):
                    e = i % a.pool
                    ce.expert_forward(x, pool["w13"][e], pool["w13_scale"][e], pool["w2"][e], pool["w2_scale"][e], r,
                                      isa=isa, num_threads=t)

                s = timed(call, a.calls, a.reps)
                roof = res["mem"].get(f"torch_sum_{t}t", float("nan"))
                row = {"M": M, "path": isa, "threads": t, "us": s * 1e6, "GBps": nb / s / 1e9}
                res["rows"].append(row)
                print(f"| {M} | {isa} | {t} | {s * 1e6:.0f} | {nb / s / 1e9:.1f} | {100 * nb / s / 1e9 / roof:.0f} % |")
        if a.no_torch:
            continue
        for t in a.threads:
            torch.set_num_threads(t)

            def ref(i):
                e = i % a.pool
                ce.expert_forward_ref(x, pool["w13"][e], pool["w13_scale"][e], pool["w2"][e], pool["w2_scale"][e], r)

            s = timed(ref, 2, 3)
            res["rows"].append({"M": M, "path": "torch dequant+matmul", "threads": t, "us": s * 1e6, "GBps": nb / s / 1e9})
            print(f"| {M} | torch: dequantize + fp32 matmul per call | {t} | {s * 1e6:.0f} | {nb / s / 1e9:.2f} | |")
            # weights dequantized to bf16 once (4x the bytes: 50 MB per expert): torch's bf16 GEMV
            n_bf = 4
            w13b = [torch.randn(2 * I, D).bfloat16() for _ in range(n_bf)]
            w2b = [torch.randn(D, I).bfloat16() for _ in range(n_bf)]
            xb = x.bfloat16()

            def bf(i):
                j = i % n_bf
                h = torch.nn.functional.linear(xb, w13b[j])
                torch.nn.functional.linear(h[:, :I], w2b[j])

            s = timed(bf, 4, 3)
            bf_bytes = (2 * I * D + D * I) * 2
            res["rows"].append({"M": M, "path": "torch bf16 linear (pre-dequantized)", "threads": t, "us": s * 1e6,
                                "GBps_bf16": bf_bytes / s / 1e9})
            print(f"| {M} | torch: bf16 F.linear on pre-dequantized weights ({bf_bytes / 1e6:.0f} MB) | {t} | {s * 1e6:.0f} | "
                  f"{bf_bytes / s / 1e9:.1f} (bf16 bytes) | |")
        torch.set_num_threads(max(a.threads))

    # Recipe B layer calls: M rows x 6 slots of cold experts, per-slot outputs (6 distinct experts a row)
    layer_calls = ((1, 6), (6, 6)) if a.pool >= 6 else ()
    if layer_calls:
        print("\n| call | threads | us | GB/s |")
        print("|---|---|---|---|")
    else:
        print(f"\n(no layer calls: a pool of {a.pool} experts has fewer than the 6 a row takes)")
    for M, k in layer_calls:
        x = (torch.randn(M, D) * 2).bfloat16()
        w = torch.rand(M, k) + 0.1
        g = torch.Generator().manual_seed(1)
        calls = [torch.stack([torch.randperm(a.pool, generator=g)[:k] for _ in range(M)]).to(torch.int32) for _ in range(8)]
        n_exp = statistics.mean(len(torch.unique(c)) for c in calls)  # distinct experts read per call
        for t in a.threads:
            def layer(i, t=t):
                return ce.experts_forward(x, calls[i % len(calls)], w, **pool, num_threads=t)

            s = timed(layer, len(calls), a.reps)
            res["rows"].append({"call": f"experts_forward M={M} k={k}", "threads": t, "us": s * 1e6, "experts": n_exp})
            print(f"| experts_forward M={M}, k={k} ({n_exp:.1f} distinct experts of {a.pool}) | {t} | {s * 1e6:.0f} | "
                  f"{n_exp * nb / s / 1e9:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
