"""Sweep of the decode attention kernel's configuration (megastep.kernels.attention.AttnConfig) at
V4-Flash shapes on one GPU: per attention kind, candidates checked and timed at B = 1 and B = 64;
the winners are printed as a Python literal for attention._PINNED.

    python benchmarks/kernels/tune_attention.py [--json FILE] [--contexts 4096,32768] [--shards 15]
        (one H200: aimed at < 90 s, compiles included)
    TRITON_INTERPRET=1 python benchmarks/kernels/tune_attention.py --smoke
        (CPU, Triton interpreter, tiny shapes: checks this script only; its times mean nothing)

Kinds (every layer of model/fast.py calls sparse_attention_pools; ModelConfig.compress_ratios):
  swa (ratio 0, 2 layers):    the window ring only, N = W = 128
  csa (ratio 4, 21 layers):   ring + the indexer's top-512 compressed entries, N = 640
  hca (ratio 128, 20 layers): ring + all n = max_ctx // 128 compressed entries, N = W + n; with
                              max_ctx = context + 128 (megastep/bench.py) n = 33, N = 161 at 4096.
  W = sliding_window (max_block 1). CSA and SWA do not depend on the context, HCA's N does: a
  pinned HCA entry applies to that max_ctx only (--contexts adds more HCA kinds).
Inputs as StatePools holds them: S = 65 slots, window [S, W, 512], comp [S, n + 1, 512] bf16
(random normals), q [B, 64, 512], sink [64], every row at position = context in its own slot,
the output's inverse RoPE from a rope_table (as FastDecoder), CSA ids = 512 random visible
entries ascending (int64, all ok). pick_config is keyed by (H, N, d): never by B.

Candidates (at most 36 per kind), in two phases, each compiled first in parallel processes that
fill Triton's disk cache (as bench_kernels.py / moe_variants.py):
  1. pick_config's rule, and block_h in (16, 32, 64) x chunk in (32, 64, 128, 256) with
     block_n 32, num_warps 4 (block_h 16) or 8, num_stages 2. Chunks past the first one >= N
     are dropped (the same single chunk).
  2. the best one's combine with more chunk partials or wider column slabs in flight (COMBINES;
     same bits), then around the 3 best of phase 1: block_n 64, num_stages 3, the other
     num_warps, block_n 64 with the other num_warps, and the value columns split over 2 or 4
     programs (dv_split; first, as the newest knob). Never block_h 64 with 4 warps (a 64 x 512 fp32 accumulator on
     128 threads) nor block_n 64 with 3 stages (3 x 64 KB of KV tiles in shared memory).
pv_pieces stays 2 (the module's precision argument).
Check (before timing; a candidate that fails or raises is reported and not timed): the B = 64
output against sparse_attention_pools_ref with the tolerance of tests/kernels/test_attention.py
(check_out: at most one bf16 step off and >= 99% bit-equal on the nope dims; the RoPE dims within
2^-5 of their pair's magnitude, >= 99% bit-equal), two runs bit-identical, and the B = 1 output
bit-identical to row 0 of the B = 64 one (batch invariance).
Timing: bench_kernels.graph_time (a CUDA graph of back-to-back calls, median of the replays, µs
per call). Consecutive calls read other pool copies (B = 64) or other (copy, slot) pairs (B = 1)
so that a graph touches about bench_kernels.L2_FLUSH_BYTES of distinct KV (at most 512 calls),
as in decode where each layer's KV comes from HBM.
Winner per kind: minimum of t1 / STEP_US[1] + t64 / STEP_US[64] over the candidates that pass:
the kernel's share of the decode step it sits in at each size (30 V4-Flash layers on one H200,
2026-12-01: ~4.5 ms at B = 1, ~47.8 ms at B = 64), so a change counts by what it does to each step.
(Normalizing by the kernel's own best time instead, tried first, let a batch-64 gain buy a
larger batch-1 loss; per-token time, t1 + t64 / 64, the reverse.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench_kernels as BK  # noqa: E402  (the kernels' shared CUDA-graph timer, L2 flush size)
from bf16_check import check_bf16  # noqa: E402  (the kernels' shared bf16 acceptance rule)

from megastep.config import CSA_RATIO, ModelConfig  # noqa: E402
from megastep.kernels import attention as A  # noqa: E402
from megastep.kernels.attention import AttnConfig  # noqa: E402
from megastep.kernels.rope_norm import rope_table  # noqa: E402
from megastep.model import ops  # noqa: E402

# the sweep's grid (--smoke: smaller)
BLOCK_HS = (16, 32, 64)
CHUNKS = (32, 64, 128, 256)
BLOCK_NS = (32, 64)
COMBINES = ((8, 128), (32, 64), (4, 256))  # (chunk partials, columns) in flight in the combine
BS = (1, 64)  # batch sizes timed: t1 at BS[0], t64 at BS[-1]
# the decode step at each size (30 layers, one H200; 8000 / 63000 until 2026-12-04, the values of 2026-11-29)
STEP_US = {1: 4509.0, 64: 47779.0}  # docs/PERFORMANCE.md, twenty-sixth measurement
TOP = 3  # phase-1 configurations that phase 2 varies
MAX_CANDS = 36  # per kind, both phases
MIN_CALLS, MAX_CALLS = 20, 512  # calls per graph
MAX_COPIES = 32  # pool copies per kind
REPS = 10  # graph replays per timing
SMOKE = False


@dataclass(frozen=True)
class Kind:
    """One attention kind: the kernel's key (H, N, d) and the pools behind it."""

    name: str
    ratio: int  # 0 swa, CSA_RATIO csa, else hca
    H: int
    d: int
    rd: int  # RoPE dims (the last rd of d)
    W: int  # window ring rows
    n: int  # compressed entries (comp has n + 1 rows)
    k: int  # CSA top-k
    pos: int  # every row's position
    max_ctx: int
    layers: int  # layers of this kind in the model (reporting only)

    @property
    def M(self) -> int:  # entries after the window, as sparse_attention_pools counts them
        return self.k if self.ratio == CSA_RATIO else self.n if self.ratio else 0

    @property
    def N(self) -> int:
        return self.W + self.M

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.H, self.N, self.d)

    def read_rows(self) -> int:
        """KV rows one batch row reads (the visible ones)."""
        win = min(self.W, self.pos + 1)
        if self.ratio == 0:
            return win
        vis = min(self.n, (self.pos + 1) // self.ratio)
        return win + (min(self.k, vis) if self.ratio == CSA_RATIO else vis)


def model_kinds(contexts=(4096,), smoke=False) -> list[Kind]:
    """The kinds of V4-Flash (ModelConfig's defaults) at each context; smoke: tiny ones."""
    if smoke:
        ctx, W = 160, 16
        return [Kind("swa", 0, 20, 32, 8, W, 0, 0, ctx, ctx + W, 1),
                Kind("csa", CSA_RATIO, 20, 32, 8, W, (ctx + W) // CSA_RATIO, 24, ctx, ctx + W, 1),
                Kind("hca", 8, 20, 32, 8, W, (ctx + W) // 8, 0, ctx, ctx + W, 1)]
    cfg = ModelConfig()
    ratios = cfg.compress_ratios[: cfg.num_hidden_layers]
    out, keys = [], set()
    for r in sorted(set(ratios)):
        for ctx in contexts:
            max_ctx = ctx + 128  # megastep/bench.py's FastDecoder(max_ctx=context + 128)
            kind = {"sliding": "swa"}.get(cfg.layer_kind(ratios.index(r)), cfg.layer_kind(ratios.index(r)))
            kd = Kind(kind if r in (0, CSA_RATIO) else f"{kind}@{ctx}", r, cfg.num_attention_heads, cfg.head_dim,
                      cfg.qk_rope_head_dim, cfg.sliding_window, max_ctx // r if r else 0,
                      cfg.index_topk if r == CSA_RATIO else 0, ctx, max_ctx, ratios.count(r))
            if kd.key not in keys:  # swa / csa: the same at every context
                keys.add(kd.key)
                out.append(kd)
    return out


def rule_config(H: int, N: int, d: int) -> AttnConfig:
    """pick_config's rule, whatever _PINNED holds."""
    saved = dict(A._PINNED)
    A._PINNED.clear()
    try:
        return A.pick_config(H, N, d)
    finally:
        A._PINNED.update(saved)


def short(c: AttnConfig, N: int | None = None, H: int | None = None) -> str:
    s = f"h{c.block_h} n{c.block_n} c{c.chunk} w{c.num_warps} s{c.num_stages}"
    if c.pv_pieces != 2:
        s += f" p{c.pv_pieces}"
    if (c.combine_group, c.combine_cols) != (4, 128):
        s += f" g{c.combine_group}x{c.combine_cols}"
    if c.dv_split != 1:
        s += f" v{c.dv_split}"
    if c.maxnreg:
        s += f" r{c.maxnreg}"
    if N is not None and H is not None:
        split = max(1, -(-N // c.chunk))
        s += f" (S={split} progs/row={-(-H // c.block_h) * split})"
    return s


# ---- candidates ---------------------------------------------------------------------------------
def allowed(c: AttnConfig) -> bool:
    return (c.chunk >= c.block_n and c.chunk % c.block_n == 0 and not (c.block_h == 64 and c.num_warps < 8)
            and not (c.block_n == 64 and c.num_stages > 2))


def phase1(kind: Kind) -> list[AttnConfig]:
    chunks = [c for c in sorted(CHUNKS) if c < kind.N]
    chunks += [c for c in sorted(CHUNKS) if c >= kind.N][:1]
    out = [rule_config(*kind.key)]
    for bh in BLOCK_HS:
        for ch in chunks:
            out.append(AttnConfig(bh, BLOCK_NS[0], ch, pv_pieces=2, num_warps=4 if bh == 16 else 8, num_stages=2))
    return [c for c in dict.fromkeys(out) if allowed(c)][:MAX_CANDS]


def variants(base: AttnConfig) -> list[AttnConfig]:
    alt_bn = [b for b in BLOCK_NS if b != base.block_n]
    alt_w = 4 if base.num_warps == 8 else 8
    out = [replace(base, dv_split=v) for v in (2, 4, 8) if v != base.dv_split]
    out += [replace(base, block_n=b) for b in alt_bn]
    out.append(replace(base, num_stages=3 if base.num_stages == 2 else 2))
    out.append(replace(base, num_warps=alt_w))
    out += [replace(base, block_n=b, num_warps=alt_w) for b in alt_bn]
    return [c for c in out if allowed(c)]


def phase2(tried: list[AttnConfig], ranked: list[AttnConfig]) -> list[AttnConfig]:
    # the best one's combine first (S > 1: more chunk partials or wider column slabs in flight,
    # the same bits), then the variants of the TOP best
    out = [replace(ranked[0], combine_group=g, combine_cols=c) for g, c in COMBINES] if ranked else []
    for base in ranked[:TOP]:
        out += [c for c in variants(base) if c not in tried and c not in out]
    return out[: max(0, MAX_CANDS - len(tried))]


def objective(rows: list[dict]) -> None:
    """Adds "score" (t1 / STEP_US[1] + t64 / STEP_US[64]: the shares of the two steps) to the
    timed rows."""
    for r in rows:
        if r["ok"] and r.get("t1") is not None:
            r["score"] = r["t1"] / STEP_US[1] + r["t64"] / STEP_US[64]


def ranked(rows: list[dict]) -> list[AttnConfig]:
    return [r["cfg"] for r in sorted((r for r in rows if "score" in r), key=lambda r: r["score"])]


# ---- inputs -------------------------------------------------------------------------------------
def rope_for(kind: Kind, device) -> torch.Tensor:
    cfg = replace(ModelConfig(), qk_rope_head_dim=kind.rd)
    return rope_table(ops.rope_inv_freq(cfg, kind.ratio > 0).to(device), kind.max_ctx + 1)


def copies_for(kind: Kind, bmax: int) -> tuple[int, int, int]:
    """(pool copies, calls per graph at B = 1, at B = bmax)."""
    if SMOKE:
        return 1, 1, 1
    row = kind.read_rows() * kind.d * 2
    n1 = max(MIN_CALLS, min(MAX_CALLS, math.ceil(BK.L2_FLUSH_BYTES / row)))
    nb = max(MIN_CALLS, min(MAX_CALLS, math.ceil(BK.L2_FLUSH_BYTES / (bmax * row))))
    copies = min(MAX_COPIES, max(math.ceil(BK.L2_FLUSH_BYTES / (bmax * row)), math.ceil(n1 / bmax), 1))
    return copies, n1, nb


class Inputs:
    """The pools of one kind (`copies` copies, bmax + 1 slots: the last the dummy, unused), one q
    [bmax, H, d], and the call lists: calls[B] = list of (args, kwargs) of sparse_attention_pools."""

    def __init__(self, kind: Kind, device, bmax: int, copies: int, n1: int = 1, nb: int = 1, seed: int = 0):
        self.kind = kind
        d, H, S = kind.d, kind.H, bmax + 1
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=device).bfloat16()

        self.pools = [(rnd(S, kind.W, d), rnd(S, kind.n + 1, d) if kind.ratio else None) for _ in range(copies)]
        self.q = rnd(bmax, H, d)
        self.sink = torch.randn(H, generator=g, device=device)
        self.slots = torch.arange(bmax, dtype=torch.int64, device=device)
        self.pos = torch.full((bmax,), kind.pos, dtype=torch.int64, device=device)
        self.rope = rope_for(kind, device)
        self.scale = d**-0.5
        self.idx = self.ok = None
        if kind.ratio == CSA_RATIO:  # k ids ascending, the visible ones first (as the indexer's)
            vis = min(kind.n, (kind.pos + 1) // kind.ratio)
            sc = torch.rand(bmax, kind.n, generator=g, device=device)
            sc[:, vis:] -= 2.0
            self.idx = sc.topk(kind.k, dim=1).indices.sort(dim=1).values
            self.ok = self.idx < vis
        self.calls = {1: [self.args(j % copies, slice((j // copies) % bmax, (j // copies) % bmax + 1)) for j in range(n1)],
                      bmax: [self.args(j % copies, slice(0, bmax)) for j in range(nb)]}

    def args(self, copy: int, rows: slice):
        win, comp = self.pools[copy]
        kw = dict(ratio=self.kind.ratio, window_size=self.kind.W)
        if self.kind.ratio:
            kw["comp"] = comp
        if self.idx is not None:
            kw["idx"], kw["idx_ok"] = self.idx[rows], self.ok[rows]
        return (self.q[rows], win, self.slots[rows], self.pos[rows], self.sink, self.scale, self.rope), kw

    def run(self, B: int, cfg: AttnConfig | None, j: int = 0) -> torch.Tensor:
        a, kw = self.calls[B][j]
        return A.sparse_attention_pools(*a, **kw, config=cfg)


def check_out(y: torch.Tensor, ref: torch.Tensor, rd: int) -> tuple[bool, str]:
    """tests/kernels/test_attention.py's check_out (importing the test module would reload the
    kernel module under the interpreter): check_bf16 on the nope dims; on the RoPE dims within
    2^-5 of the larger value of each pair and >= 99% bit-equal."""
    try:
        check_bf16(y[..., :-rd], ref[..., :-rd])
        y, ref = y[..., -rd:].float().cpu(), ref[..., -rd:].float().cpu()
        mag = ref.unflatten(-1, (-1, 2)).abs().amax(-1, keepdim=True).expand(*ref.shape[:-1], rd // 2, 2).flatten(-2)
        err = (y - ref).abs()
        assert (err <= 2**-5 * mag).all(), f"RoPE dims off by up to {err.max().item():.3g}"
        diff = (y != ref).sum().item()
        assert diff <= max(2, 0.01 * y.numel()), f"RoPE dims: {diff} of {y.numel()} not bit-equal"
    except AssertionError as e:
        return False, str(e)[:200]
    return True, "ok"


# ---- parallel compilation -------------------------------------------------------------------------
def warm_worker(path: str, shard: int, shards: int) -> None:
    """Runs every shards-th job of the file once at B = 1 on one small pool (the same
    specializations as the timed calls: no kernel argument depends on B or S)."""
    with open(path) as f:
        spec = json.load(f)
    device = spec["device"]
    kinds = [Kind(**k) for k in spec["kinds"]]
    inputs = {}
    for i, (ki, cfg) in enumerate(spec["jobs"]):
        if i % shards != shard:
            continue
        cfg = AttnConfig(**cfg)
        try:
            if ki not in inputs:
                inputs[ki] = Inputs(kinds[ki], device, bmax=1, copies=1)
            inputs[ki].run(1, cfg)
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"warm error {kinds[ki].name} {short(cfg)}: {e!r}"[:600], flush=True)


def start_warm(kinds: list[Kind], jobs: list[tuple[int, AttnConfig]], device: str, shards: int):
    """Starts the compile processes (bench_kernels.start_workers); returns a handle for finish_warm."""
    return BK.start_workers(__file__, dict(device=device, kinds=[asdict(k) for k in kinds], jobs=[(i, asdict(c)) for i, c in jobs]), len(jobs), shards, ())


def finish_warm(handle, log) -> None:
    BK.finish_workers(handle, log)


# ---- the sweep ------------------------------------------------------------------------------------
def measure(inp: Inputs, cfg: AttnConfig, ref: torch.Tensor, bmax: int, rule: AttnConfig, phase: int) -> dict:
    kind = inp.kind
    r = dict(kind=kind.name, H=kind.H, N=kind.N, d=kind.d, cfg=cfg, config=short(cfg, kind.N, kind.H), phase=phase,
             rule=cfg == rule, ok=False, msg="", t1=None, t64=None)
    try:
        o = inp.run(bmax, cfg)
        ok, msg = check_out(o, ref, kind.rd)
        if ok and not torch.equal(o, inp.run(bmax, cfg)):
            ok, msg = False, "not deterministic"
        if ok and not torch.equal(inp.run(1, cfg), o[:1]):
            ok, msg = False, "B=1 differs from row 0 of the batch"
        r.update(ok=ok, msg=msg)
        if ok:
            for B, name in ((1, "t1"), (bmax, "t64")):
                fns = [lambda a=a, kw=kw: A.sparse_attention_pools(*a, **kw, config=cfg) for a, kw in inp.calls[B]]
                r[name] = BK.graph_time(fns, reps=REPS)[0]
    except Exception as e:  # noqa: BLE001
        r.update(ok=False, msg=f"raised {e!r}"[:300])
        traceback.print_exc(limit=-3)
    return r


def fmt_row(r: dict, winner: bool = False) -> str:
    t = (lambda v: f"{v:9.1f}" if v is not None else "        -")
    sc = f"{r['score']:6.3f}" if "score" in r else "     -"
    tag = ("*" if winner else " ") + ("r" if r["rule"] else " ")
    return (f"{tag} {r['kind']:10s} {r['N']:5d} {r['config']:40s} {t(r['t1'])} {t(r['t64'])} {sc}  "
            f"{'ok' if r['ok'] else 'FAIL ' + r['msg']}")


def sweep(device, log=print, *, contexts=(4096,), shards: int | None = None, table: list | None = None
          ) -> dict[tuple[int, int, int], AttnConfig]:
    """Checks and times the candidates of every V4-Flash attention kind at B = 1 and B = 64 on
    `device` ("cuda" / a cuda device; "cpu" only with --smoke's settings, under the interpreter)
    -> {(H, N, d): winner}. Every row (dicts: kind, N, config, t1, t64, score, ok, msg, ...) is
    appended to `table` when given."""
    device = str(torch.device(device))
    cpu = device == "cpu"
    kinds = model_kinds(contexts, smoke=SMOKE)
    bmax = BS[-1]
    shards = shards or (1 if cpu else max(1, min(16, (os.cpu_count() or 8) - 1)))
    t0 = time.time()
    cands = {k.name: phase1(k) for k in kinds}
    handle = start_warm(kinds, [(i, c) for i, k in enumerate(kinds) for c in cands[k.name]], device, shards)
    # meanwhile: the inputs, the references, the clocks up
    inputs, refs = {}, {}
    for k in kinds:
        copies, n1, nb = copies_for(k, bmax)
        inputs[k.name] = Inputs(k, device, bmax, copies, n1, nb)
        a, kw = inputs[k.name].calls[bmax][0]
        refs[k.name] = A.sparse_attention_pools_ref(*a, **kw)
        log(f"{k.name}: H={k.H} N={k.N} d={k.d} ({k.layers} layers) pools x{copies}, graphs of {n1} calls at B=1, "
            f"{nb} at B={bmax}")
    if not cpu:
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(100):
            x @ x
        torch.cuda.synchronize()
        del x
    finish_warm(handle, log)
    rows = {k.name: [] for k in kinds}

    def run_phase(phase, todo):
        for k in kinds:
            rule = rule_config(*k.key)
            for c in todo[k.name]:
                r = measure(inputs[k.name], c, refs[k.name], bmax, rule, phase)
                rows[k.name].append(r)
                log(fmt_row(r))
            objective(rows[k.name])

    run_phase(1, cands)
    todo = {k.name: phase2(cands[k.name], ranked(rows[k.name])) for k in kinds}
    jobs = [(i, c) for i, k in enumerate(kinds) for c in todo[k.name]]
    if jobs:
        finish_warm(start_warm(kinds, jobs, device, shards), log)
        run_phase(2, todo)
    winners = {}
    log(f"\n{'':2s} {'kind':10s} {'N':>5s} {'config (* winner, r rule)':40s} {'t(B=1)':>9s} {'t(B=' + str(bmax) + ')':>9s} "
        f"{'score':>6s}  check   [µs per call]")
    for k in kinds:
        rs = sorted(rows[k.name], key=lambda r: (r.get("score", math.inf), r["config"]))
        best = ranked(rows[k.name])[:1]
        if best:
            winners[k.key] = best[0]
        for r in rs:
            r["winner"] = bool(best) and r["cfg"] == best[0]
            log(fmt_row(r, r["winner"]))
        if not best:
            log(f"  {k.name}: no candidate passed; nothing pinned")
    log(f"sweep: {time.time() - t0:.1f} s")
    log("\n# megastep/kernels/attention.py, from benchmarks/kernels/tune_attention.py on "
        f"{'cpu (smoke)' if cpu else torch.cuda.get_device_name(device)}:")
    log("_PINNED: dict[tuple[int, int, int], AttnConfig] = {")
    for k in kinds:
        if k.key not in winners:
            continue
        w = next(r for r in rows[k.name] if r["winner"])
        rule = next((r for r in rows[k.name] if r["rule"] and r["t1"] is not None), None)
        vs = f" (rule {rule['t1']:.1f} / {rule['t64']:.1f})" if rule else ""
        log(f"    {k.key}: {winners[k.key]!r},  # {k.name}: {w['t1']:.1f} / {w['t64']:.1f} us at B=1 / {bmax}{vs}")
    log("}")
    if table is not None:
        for k in kinds:
            table.extend({**{n: v for n, v in r.items() if n != "cfg"}, "cfg": asdict(r["cfg"])} for r in rows[k.name])
    return winners


def install(winners: dict[tuple[int, int, int], AttnConfig]) -> None:
    """Makes pick_config return the winners (attention._PINNED) in this process."""
    for key, cfg in winners.items():
        cfg.check()
        A._PINNED[tuple(key)] = cfg


def smoke_settings() -> None:
    global BLOCK_HS, CHUNKS, BLOCK_NS, BS, TOP, MAX_CANDS, REPS, SMOKE
    SMOKE = True
    BLOCK_HS, CHUNKS, BLOCK_NS = (16, 32), (16, 32), (16, 32)
    BS, TOP, MAX_CANDS, REPS = (1, 3), 1, 6, 1
    BK.DEV = "cpu"  # graph_time: eager calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    ap.add_argument("--json", help="write the table (and the winners) to this file")
    ap.add_argument("--contexts", default="4096", help="comma-separated contexts (HCA's N depends on it)")
    BK.add_worker_arguments(ap)
    args = ap.parse_args()
    contexts = tuple(int(c) for c in args.contexts.split(","))
    BK.run_tuner(args, args.smoke or bool(args.warm and os.environ.get("TRITON_INTERPRET") == "1"), smoke_settings,
                 warm_worker, lambda device, table: sweep(device, contexts=contexts, shards=args.shards, table=table),
                 install, A.pick_config)

if __name__ == "__main__":
    main()
