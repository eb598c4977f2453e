"""Routed MXFP4 experts at V4-Flash shapes (E 256, D 4096, I 2048, top-6): every MoE mode/config
candidate checked and timed, and the address-table path with cold experts in pinned host memory.

    python benchmarks/kernels/moe_variants.py --out DIR        (one H200: ~1-2 minutes)
    python benchmarks/kernels/moe_variants.py --smoke --out DIR   (CPU interpreter, tiny shapes:
                                                                    checks this script only)
    options: --ms 1,64 (batch sizes), --cands 0,2,5 (indices into CANDIDATES), --no-cold

1. Candidates (megastep.kernels.moe.MoeConfig, <= 12) are compiled first in parallel processes
   (Triton's disk cache), each against a table whose 256 entries all point at one expert.
2. For M in 1, 4, 16, 64 and each candidate: the output of routing 0 against
   moe_experts_mxfp4_ref (rel. L2, max |err| / max |ref|, the tests' tolerance: rel <= 4e-3 and
   max <= 2e-2), two runs bit-identical, row 0 alone (M = 1 slot groups) bit-identical to row 0
   in the batch. Timing: one CUDA graph of 20 calls, call i on layer copy i % 2 of the stacked
   experts (2 x 3.3 GB) with random routing i (fixed seed), so that consecutive calls read other
   experts and nothing is served from the 60 MB L2; median of 20 replays, µs per call. GB/s
   counts the distinct experts' bytes (weights + scales) of each call.
3. Cold experts at M = 1: an ExpertTable whose experts are views of the device copy except a
   fraction (0, 0.1, 0.5; fixed random choice) copied to pinned host memory, read by the kernels
   through their device-visible address. Output bit-identical to the all-device table; time per
   call; host-link GB/s = cold bytes per call / time, and / (time - time of the all-device table).
Prints a compact table last; JSON (and the log) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

SHAPE = dict(E=256, D=4096, I=2048, k=6)
MS = (1, 4, 16, 64)
N_CALLS = 20  # calls per graph (each its own routing)
N_COPIES = 2  # stacked layer copies rotated by the calls
COLD_FRACTIONS = (0.0, 0.1, 0.5)
SMOKE = False
LOG = None

# (mode, block_i, block_d, block_k, num_warps, num_stages, programs per SM): pick_config's rule
# for the slot groups with that target. The first of each mode is what pick_config returns.
CANDIDATES = [
    ("fma", 16, 32, 128, 4, 3, 8),
    ("dot", 32, 64, 128, 4, 3, 4),
    ("dot_asm", 32, 64, 128, 4, 3, 4),
    ("dot_scaled", 32, 64, 128, 4, 3, 4),
    ("dot_asm", 32, 64, 128, 4, 1, 4),  # weights not pipelined: fewer instructions/byte, loads exposed
    ("dot_asm", 32, 64, 128, 4, 4, 4),  # deeper pipeline
    ("dot_asm", 16, 32, 128, 4, 3, 8),  # 32-row tiles (mma.sync): twice the programs at M=1
    ("dot_asm", 16, 32, 128, 4, 1, 8),
    ("dot_asm", 32, 64, 256, 4, 1, 4),  # fewer instructions/byte, 173 registers
    ("dot_asm", 64, 128, 128, 8, 3, 2),  # 128-row tiles, two warpgroups
    ("dot_scaled", 32, 64, 128, 4, 1, 4),
    ("dot_asm", 32, 64, 128, 8, 3, 4),  # two warpgroups on a 64-row tile (126 / 3286 µs: half the speed)
    ("dot_asm", 32, 64, 128, 4, 5, 4),  # deeper still (2026-11-30: 73.8 / 242 us at M = 1 / 4, 4 stages 61.2 / 231)
]


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    if LOG:
        LOG.write(s + "\n")
        LOG.flush()


def config(MOE, cand, M):
    mode, bi, bd, bk, nw, ns, per_sm = cand
    E, D, I, k = (SHAPE[n] for n in ("E", "D", "I", "k"))
    slots = min(M * k, E)
    g_up = max(1, min(slots, per_sm * 132 // -(-I // bi)))
    g_down = max(1, min(slots, per_sm * 132 // -(-D // bd)))
    return MOE.MoeConfig(bi, bd, 1 if mode == "fma" else 16, bk, g_up, g_down, num_warps=nw, num_stages=ns, mode=mode)


def short(cand):
    mode, bi, bd, bk, nw, ns, per_sm = cand
    return f"{mode} i{bi} d{bd} k{bk} w{nw} s{ns} x{per_sm}"


def dev():
    return "cpu" if SMOKE else "cuda"


def random_experts(E, D, I, gen):
    d = dev()
    return {
        "w13": torch.randint(-128, 128, (E, 2 * I, D // 2), generator=gen, device=d, dtype=torch.int8),
        "w13_scale": torch.randint(118, 124, (E, 2 * I, D // 32), generator=gen, device=d, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "w2": torch.randint(-128, 128, (E, D, I // 2), generator=gen, device=d, dtype=torch.int8),
        "w2_scale": torch.randint(118, 124, (E, D, I // 32), generator=gen, device=d, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }


def routing(M, gen):
    E, k = SHAPE["E"], SHAPE["k"]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, k, generator=gen) + 0.1
    return ids.to(dev()), wts.to(dev())


def expert_bytes():
    D, I = SHAPE["D"], SHAPE["I"]
    return 2 * I * D // 2 + 2 * I * D // 32 + D * I // 2 + D * I // 32


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


# ---- 1. parallel compilation ------------------------------------------------------------------------
def warm_worker(shard, shards):
    """Runs every shards-th candidate once per M on a table whose experts all alias one expert
    (same specializations as the real run, 13 MB instead of 3.3 GB)."""
    from megastep.kernels import moe as MOE
    E, D, I = SHAPE["E"], SHAPE["D"], SHAPE["I"]
    one = random_experts(1, D, I, torch.Generator(device=dev()).manual_seed(0))
    tab = MOE.ExpertTable.from_experts([tuple(one[n][0] for n in ("w13", "w13_scale", "w2", "w2_scale"))] * E)
    gen = torch.Generator().manual_seed(1)
    for i, cand in enumerate(CANDIDATES):
        if i % shards != shard:
            continue
        for M in MS:
            try:
                x = torch.randn(M, D, generator=gen).bfloat16().to(dev())
                MOE.moe_experts_table(x, *routing(M, gen), tab, config=config(MOE, cand, M))
                sync()
            except Exception as e:  # noqa: BLE001
                print(f"warm error {short(cand)} M={M}: {e!r}"[:600], flush=True)
                break


def parallel_warm(args, shards=8):
    t0 = time.time()
    extra = (["--cands", args.cands] if args.cands else []) + (["--ms", args.ms] if args.ms else [])
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-shard", str(i), "--warm-shards", str(shards)] + extra,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(shards)]
    for p in procs:
        out, _ = p.communicate()
        for line in out.splitlines():
            if "error" in line.lower():
                log("  " + line[:600])
    log(f"compiled {len(CANDIDATES)} candidates x {len(MS)} M in {shards} processes: {time.time() - t0:.1f}s")


# ---- 2. candidates ------------------------------------------------------------------------------------
def compare(y, ref):
    y, ref = y.float(), ref.float()
    rel = ((y - ref).norm() / ref.norm()).item()
    mx = ((y - ref).abs().max() / ref.abs().max()).item()
    ok = rel <= 4e-3 and mx <= 2e-2 and bool(torch.isfinite(y).all())
    return ok, rel, mx


def bench_candidates(MOE, graph_time, copies, results):
    E, D, I, k = (SHAPE[n] for n in ("E", "D", "I", "k"))
    gen = torch.Generator().manual_seed(7)
    per_expert = expert_bytes()
    for M in MS:
        x = (torch.randn(M, D, generator=gen) * torch.exp2(torch.randint(-2, 3, (M, 1), generator=gen).float())).bfloat16().to(dev())
        routes = [routing(M, gen) for _ in range(N_CALLS)]
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in routes)
        nbytes = distinct * per_expert
        t0 = time.time()
        ref = MOE.moe_experts_mxfp4_ref(x, *routes[0], **copies[0])
        log(f"M={M}: {distinct:.1f} distinct experts / call ({nbytes / 1e6:.0f} MB), ref {time.time() - t0:.1f}s")
        for cand in CANDIDATES:
            cfg = config(MOE, cand, M)
            r = dict(M=M, candidate=short(cand), config=asdict(cfg), distinct_experts=distinct, mbytes=nbytes / 1e6)
            try:
                y = MOE.moe_experts_mxfp4(x, *routes[0], **copies[0], config=cfg)
                y2 = MOE.moe_experts_mxfp4(x, *routes[0], **copies[0], config=cfg)
                alone = MOE.moe_experts_mxfp4(x[:1], routes[0][0][:1], routes[0][1][:1], **copies[0], config=config(MOE, cand, 1))
                ok, rel, mx = compare(y, ref)
                r.update(ok=ok, rel_l2=rel, max_err_rel=mx, max_abs_err=(y - ref).abs().max().item(),
                         deterministic=torch.equal(y, y2), batch_invariant=torch.equal(alone[0], y[0]))
                calls = [lambda ids=ids, wts=wts, ex=copies[i % len(copies)], c=cfg: MOE.moe_experts_mxfp4(x, ids, wts, **ex, config=c)
                         for i, (ids, wts) in enumerate(routes)]
                med, best = graph_time(calls)
                r.update(us=med, us_min=best, gbps=nbytes / med / 1e3)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile or run: report, go on)
                r.update(ok=False, error=repr(e)[:800])
                log(traceback.format_exc()[-2000:])
            results.append(r)
            log(json.dumps({k_: (round(v, 6) if isinstance(v, float) else v) for k_, v in r.items() if k_ != "config"}))


# ---- 3. cold experts in pinned host memory ----------------------------------------------------------------
def bench_cold(MOE, graph_time, stacked, results):
    E, D = SHAPE["E"], SHAPE["D"]
    names = ("w13", "w13_scale", "w2", "w2_scale")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, D, generator=gen).bfloat16().to(dev())
    routes = [routing(1, gen) for _ in range(N_CALLS)]
    order = torch.randperm(E, generator=gen).tolist()
    per_expert = expert_bytes()
    hot = [tuple(stacked[n][e] for n in names) for e in range(E)]
    base = {}  # mode -> (y of routing 0, µs) with every expert on the device
    seen = set()
    modes = [c for c in CANDIDATES if c[0] not in seen and not seen.add(c[0])]  # each mode's first (picked) config
    for frac in COLD_FRACTIONS:
        cold = set(order[: round(frac * E)])
        experts = list(hot)
        t0 = time.time()
        for e in sorted(cold):  # a pinned host copy of each cold expert, four allocations each
            experts[e] = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=not SMOKE).copy_(t) for t in hot[e])
        tab = MOE.ExpertTable.from_experts(experts, device=dev())
        cold_mb = statistics.mean(sum(per_expert for e in torch.unique(ids).tolist() if e in cold) for ids, _ in routes) / 1e6
        log(f"cold fraction {frac}: {len(cold)} experts in pinned host memory ({time.time() - t0:.1f}s to copy), "
            f"{cold_mb:.1f} MB cold per call")
        for cand in modes:
            cfg = config(MOE, cand, 1)
            r = dict(cold_fraction=frac, candidate=short(cand), cold_mb_per_call=cold_mb)
            try:
                y = MOE.moe_experts_table(x, *routes[0], tab, config=cfg)
                sync()
                calls = [lambda ids=ids, wts=wts, c=cfg, t=tab: MOE.moe_experts_table(x, ids, wts, t, config=c) for ids, wts in routes]
                med, best = graph_time(calls)
                r.update(us=med, us_min=best)
                if frac == 0:
                    base[cand[0]] = (y, med)
                else:
                    y0, us0 = base[cand[0]]
                    r.update(same_as_device=torch.equal(y, y0), link_gbps=cold_mb * 1e3 / med,
                             link_gbps_extra=(cold_mb * 1e3 / (med - us0)) if med > us0 else None)
            except Exception as e:  # noqa: BLE001
                r.update(error=repr(e)[:800])
                log(traceback.format_exc()[-2000:])
            results.append(r)
            log(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()}))
        del tab, experts
        if not SMOKE:
            torch.cuda.empty_cache()


def profile_kernels(MOE, copies, results):
    """Per-kernel device time (torch.profiler, eager calls) of each mode's first candidate at
    every M: where a call's time goes (routing + x quant, gate-up, act quant, down)."""
    if SMOKE:
        return
    from torch.profiler import ProfilerActivity, profile
    D = SHAPE["D"]
    gen = torch.Generator().manual_seed(5)
    seen = set()
    firsts = [c for c in CANDIDATES if c[0] not in seen and not seen.add(c[0])]
    for M in MS:
        x = torch.randn(M, D, generator=gen).bfloat16().to(dev())
        routes = [routing(M, gen) for _ in range(10)]
        for cand in firsts:
            cfg = config(MOE, cand, M)
            try:
                for i, (ids, wts) in enumerate(routes[:2]):
                    MOE.moe_experts_mxfp4(x, ids, wts, **copies[i % len(copies)], config=cfg)
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for i, (ids, wts) in enumerate(routes):
                        MOE.moe_experts_mxfp4(x, ids, wts, **copies[i % len(copies)], config=cfg)
                    sync()
                per = {}
                for ev in prof.events():
                    if ev.device_type.name == "CUDA" and "_moe_" in ev.name:
                        per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / len(routes)
                r = dict(M=M, candidate=short(cand), kernels_us={k: round(v, 2) for k, v in per.items()})
            except Exception as e:  # noqa: BLE001
                r = dict(M=M, candidate=short(cand), error=repr(e)[:400])
            results.append(r)
            log(json.dumps(r))


def print_table(bw, results, cold, prof=()):
    log("")
    log(f"roofline: streaming read {bw:.0f} GB/s. us per call (graph replay), GB/s of distinct expert bytes, %roofline;"
        " ok = within the tests' tolerance of the ref, det = two runs identical, inv = row alone == row in batch")
    log(f"{'candidate':34} " + " ".join(f"{'M=' + str(M):>22}" for M in MS))
    by = {}
    for r in results:
        by.setdefault(r["candidate"], {})[r["M"]] = r
    for cand, rows in by.items():
        cells = []
        for M in MS:
            r = rows.get(M)
            if r is None or "us" not in r:
                cells.append(f"{'FAIL' if r else '-':>22}")
                continue
            flags = ("" if r["ok"] else "!ok") + ("" if r["deterministic"] else "!det") + ("" if r["batch_invariant"] else "!inv")
            cells.append(f"{r['us']:8.1f} {r['gbps']:5.0f} {100 * r['gbps'] / bw:3.0f}%{flags:>4}")
        log(f"{cand:34} " + " ".join(cells))
    errs = [r for r in results if "error" in r]
    for r in errs[:12]:
        log(f"  FAILED {r['candidate']} M={r['M']}: {r['error'][:200]}")
    if prof:
        log("")
        log("per-kernel device time, µs (eager calls, profiler): prep = routing + x quant, act = activation quant")
        for r in prof:
            k = r.get("kernels_us", {})
            names = [("prep", "_moe_prep_kernel"), ("gate_up", "_moe_gate_up_kernel"), ("act", "_moe_act_quant_kernel"),
                     ("down", "_moe_down_kernel")]
            log(f"  M={r['M']:3d} {r['candidate']:34} " + " ".join(f"{a}={k.get(n, float('nan')):8.1f}" for a, n in names)
                + (f" ERROR {r['error'][:100]}" if "error" in r else ""))
    log("")
    log(f"cold experts in pinned host memory, M=1: {'candidate':28} {'cold':>5} {'MB/call':>8} {'us':>8} {'GB/s':>6} {'GB/s extra':>10} same")
    for r in cold:
        if "us" not in r:
            log(f"{'':40}{r['candidate']:28} {r['cold_fraction']:5.2f} FAILED {r.get('error', '')[:100]}")
            continue
        gb = f"{r['link_gbps']:6.1f}" if r.get("link_gbps") is not None else f"{'-':>6}"
        gx = f"{r['link_gbps_extra']:10.1f}" if r.get("link_gbps_extra") is not None else f"{'-':>10}"
        log(f"{'':40}{r['candidate']:28} {r['cold_fraction']:5.2f} {r['cold_mb_per_call']:8.1f} {r['us']:8.1f} {gb} {gx} "
            f"{r.get('same_as_device', '-')}")


def main():
    global LOG, SMOKE, SHAPE, MS, N_CALLS, CANDIDATES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/moe_variants"))
    ap.add_argument("--warm-shard", type=int, default=-1)
    ap.add_argument("--warm-shards", type=int, default=8)
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    ap.add_argument("--ms", help="comma-separated batch sizes (default 1,4,16,64)")
    ap.add_argument("--cands", help="comma-separated indices into CANDIDATES (default all)")
    ap.add_argument("--no-cold", action="store_true", help="skip the pinned-host-memory part")
    args = ap.parse_args()
    if args.cands:
        CANDIDATES = [CANDIDATES[int(i)] for i in args.cands.split(",")]
    if args.ms:
        MS = tuple(int(m) for m in args.ms.split(","))
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":  # kernels must be decorated in interpreter mode
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(sys.executable, [sys.executable] + sys.argv)
        SMOKE = True
        SHAPE = dict(E=16, D=128, I=64, k=3)
        MS = tuple(int(m) for m in args.ms.split(",")) if args.ms else (1, 5)
        N_CALLS = 3
        torch.set_num_threads(1)
    import bench_kernels as BK  # the kernels' shared CUDA-graph timer
    from megastep.kernels import moe as MOE
    if SMOKE:
        BK.DEV = "cpu"
    if args.warm_shard >= 0:
        warm_worker(args.warm_shard, args.warm_shards)
        return
    os.makedirs(args.out, exist_ok=True)
    LOG = open(os.path.join(args.out, "moe_variants_log.txt"), "w")
    t_start = time.time()
    if SMOKE:
        name, bw = "cpu (Triton interpreter, smoke)", 1.0
    else:
        p = torch.cuda.get_device_properties(0)
        name = p.name
        log(f"device {p.name} sms={p.multi_processor_count} torch {torch.__version__} triton {__import__('triton').__version__}")
        if not args.no_warm:
            parallel_warm(args, args.warm_shards)
        bw = BK.measure_bandwidth()["read"]
        log(f"streaming read {bw:.0f} GB/s")
    gen = torch.Generator(device=dev()).manual_seed(1)
    E, D, I = SHAPE["E"], SHAPE["D"], SHAPE["I"]
    copies = [random_experts(E, D, I, gen) for _ in range(N_COPIES)]
    results, cold, prof = [], [], []
    out_json = os.path.join(args.out, "moe_variants.json")

    def save():
        with open(out_json, "w") as f:
            json.dump(dict(device=name, read_gbps=bw, shape=SHAPE, candidates=[short(c) for c in CANDIDATES],
                           results=results, cold=cold, kernels=prof), f, indent=1)

    try:
        bench_candidates(MOE, BK.graph_time, copies, results)
        save()
        profile_kernels(MOE, copies, prof)
        save()
        if not args.no_cold:
            bench_cold(MOE, BK.graph_time, copies[0], cold)
    finally:
        save()
        print_table(bw, results, cold, prof)
        log(f"total {time.time() - t_start:.0f}s; JSON: {out_json}")


if __name__ == "__main__":
    main()
