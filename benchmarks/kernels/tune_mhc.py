"""Sweep of the mHC kernels' configuration (megastep.kernels.mhc.MhcConfig) at V4-Flash shapes on
one GPU: candidates checked, then timed at B = 1 and B = 64; the winner is printed as a Python
literal for mhc._PINNED.

    python benchmarks/kernels/tune_mhc.py [--json FILE] [--allow-bit-changes] [--shards N]
        (one H200: aimed at < 60 s, compiles included)
    TRITON_INTERPRET=1 python benchmarks/kernels/tune_mhc.py --smoke
        (CPU, Triton interpreter, tiny shapes: checks this script only; its times mean nothing)

Shapes (ModelConfig's defaults, as model/fast.py calls the kernels): h [B, hc, D] bf16 with hc = 4,
D = 4096; mhc_pre: fn [(2 + hc) hc, hc D] = [24, 16384] fp32, scale [3], base [24], norm weight [D]
fp32, hc_sinkhorn_iters 20; mhc_head: fn [hc, hc D], scale [1], base [hc]; mhc_post: y [B, D]
bf16 and mhc_pre's post [B, hc], comb [B, hc, hc]. pick_config is keyed by (hc, D), never by B.

Candidates (about 14), all around the configuration pick_config returns now (the "current" one):
  1. the finish: finish_warps 1 (block_d 1024, chunked: a one-warp row does not fit in registers),
     2 (one pass, and block_d D/2), 8, 16; sinkhorn_apart off (4 and 8 warps); block_d D/2;
     the Sinkhorn on scalars (sinkhorn_scalar, with the Sinkhorn apart and not);
     the mixes kernel's block_m 4 and 16; hc_post's post_block_d 256 and 1024.
  2. one candidate that combines the best finish (block_d, finish_warps, sinkhorn_apart/_scalar), the best
     block_m and the best post_block_d of phase 1 (the three touch different kernels).
  These change no bit (mhc's module docstring: the finish sums in fixed trees): each must give
  exactly the current configuration's outputs (the same bits: mhc_pre's x / post / comb, mhc_head's
  z and mhc_post's output, at B = 1 and B = 64) or it is reported and not timed. The current
  configuration itself is checked against the *_ref functions with the tolerances of
  tests/kernels/test_mhc.py, for determinism (two runs) and batch invariance (B = 1 == row 0).
  --allow-bit-changes adds kc 128 / 512 and num_warps 2 / 8 (the mixes kernel's fp32 sums change
  with them): those are held to the ref tolerances, determinism and batch invariance instead.
Timing: bench_kernels.graph_time (a CUDA graph of back-to-back calls, median of the replays, µs
per call). Consecutive calls use other copies of fn / base / scale / norm weight (64 copies,
96 MB of fn for mhc_pre), so the weights come from HBM as in decode, while h and y stay the same
(in decode the previous kernel has just written them: L2).
Score: t = t(mhc_pre) + t(mhc_post) (both run twice per layer); winner = minimum of
t1 / best t1 + t64 / best t64 over the candidates that pass. mhc_head (once per step) is timed and
reported only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench_kernels as BK  # noqa: E402  (the kernels' shared CUDA-graph timer)
from bf16_check import check_bf16  # noqa: E402  (the kernels' shared bf16 acceptance rule)

from megastep.config import ModelConfig  # noqa: E402
from megastep.kernels import mhc as M  # noqa: E402
from megastep.kernels.common import next_pow2  # noqa: E402
from megastep.kernels.mhc import MhcConfig  # noqa: E402
from megastep.model import ops  # noqa: E402

BS = (1, 64)  # batch sizes timed: t1 at BS[0], t64 at BS[-1]
COPIES = 64  # weight copies = calls per graph
REPS = 10  # graph replays per timing
MAX_CANDS = 16
SMOKE = False
SMOKE_D = 320  # --smoke: hc 4, D 320 (K 1280: 5 mixes programs at kc 256, a ragged last chunk)


class Shape:
    """One (hc, D) of the model with its Sinkhorn settings."""

    def __init__(self, cfg: ModelConfig, D: int | None = None):
        self.hc, self.D = cfg.hc_mult, D or cfg.hidden_size
        self.iters, self.hc_eps, self.eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.mix = (2 + self.hc) * self.hc

    @property
    def key(self) -> tuple[int, int]:
        return (self.hc, self.D)


def model_shape() -> Shape:
    return Shape(ModelConfig(), SMOKE_D if SMOKE else None)


# ---- inputs -------------------------------------------------------------------------------------
class Inputs:
    """`copies` sets of weights (pre and head), one h and one y per batch size."""

    def __init__(self, sh: Shape, device, copies: int, seed: int = 0):
        self.sh = sh
        g = torch.Generator(device=device).manual_seed(seed)
        K = sh.hc * sh.D

        def weights(mix, nscale):
            fn = torch.randn(mix, K, generator=g, device=device) * (2.0 / K**0.5)
            scale = torch.rand(nscale, generator=g, device=device) + 0.5
            base = torch.randn(mix, generator=g, device=device) * 0.5
            w = torch.rand(sh.D, generator=g, device=device) + 0.5
            return fn, scale, base, w

        self.pre_w = [weights(sh.mix, 3) for _ in range(copies)]
        self.head_w = [weights(sh.hc, 1) for _ in range(copies)]
        # the batch sizes' h and y: the first B rows of the largest (streams of different magnitudes,
        # as tests/kernels/test_mhc.py), each contiguous
        bmax = max(BS)
        mag = torch.exp2(torch.randint(-2, 3, (bmax, sh.hc, 1), generator=g, device=device).float())
        h = (torch.randn(bmax, sh.hc, sh.D, generator=g, device=device) * mag).bfloat16()
        y = (torch.randn(bmax, sh.D, generator=g, device=device) * 3).bfloat16()
        self.h = {B: h[:B].clone() for B in BS}
        self.y = {B: y[:B].clone() for B in BS}
        self.pp = {}  # (post, comb) per B: mhc_post's inputs, from the current configuration

    def pre(self, B: int, cfg: MhcConfig | None, j: int = 0):
        s = self.sh
        return M.mhc_pre(self.h[B], *self.pre_w[j], s.hc, s.iters, s.hc_eps, s.eps, config=cfg)

    def head(self, B: int, cfg: MhcConfig | None, j: int = 0):
        return M.mhc_head(self.h[B], *self.head_w[j], self.sh.hc_eps, self.sh.eps, config=cfg)

    def post(self, B: int, cfg: MhcConfig | None):
        return M.mhc_post(self.y[B], self.h[B], *self.pp[B], config=cfg)

    def outputs(self, B: int, cfg: MhcConfig | None) -> list[torch.Tensor]:
        """Everything a configuration decides: pre's (x, post, comb), head's z, post's output."""
        x, post, comb = self.pre(B, cfg)
        return [x, post, comb, self.head(B, cfg), self.post(B, cfg)]


# ---- checks (tests/kernels/test_mhc.py's tolerances; importing that module would reload mhc) -----
def check_f32(y: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor) -> None:
    """The kernel is as close to the exact result as the fp32 ref, within a factor 4."""
    y, ref32, ref64 = y.cpu().double(), ref32.cpu().double(), ref64.cpu().double()
    err, ref_err = (y - ref64).abs().max().item(), (ref32 - ref64).abs().max().item()
    assert err <= 4 * ref_err + 1e-7, f"error {err:.3g} vs the fp32 ref's {ref_err:.3g}"


def check_ref(inp: Inputs, B: int, outs: list[torch.Tensor]) -> tuple[bool, str]:
    s = inp.sh
    x, post, comb, z, o = outs
    h = inp.h[B]
    fn, scale, base, w = inp.pre_w[0]
    try:
        xr, pr, cr = M.mhc_pre_ref(h, fn, scale, base, w, s.hc, s.iters, s.hc_eps, s.eps)
        xf = h.flatten(-2).double()
        mixes = (xf @ fn.double().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + s.eps)
        _, p64, c64 = ops.sinkhorn_mixes(mixes, scale.double(), base.double(), s.hc, s.iters, s.hc_eps)
        check_f32(post, pr, p64)
        check_f32(comb, cr, c64)
        check_bf16(x, xr, max_steps=2)  # rounded twice: the bf16 collapse, then the norm
        check_bf16(z, M.mhc_head_ref(h, *inp.head_w[0], s.hc_eps, s.eps), max_steps=2)
        check_bf16(o, M.mhc_post_ref(inp.y[B], h, *inp.pp[B]), min_equal=0.999)
    except AssertionError as e:
        return False, f"vs ref: {e}"[:200]
    return True, "ok"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal alone takes -0.0 for +0.0)."""
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    """None if every output has the same bits, else the names of those that differ."""
    names = ("x", "post", "comb", "head z", "post out")
    bad = [n for n, u, v in zip(names, a, b) if u.shape != v.shape or not torch.equal(bits(u), bits(v))]
    return ", ".join(bad) or None


# ---- candidates ---------------------------------------------------------------------------------
def current_config(sh: Shape) -> MhcConfig:
    return M.pick_config(*sh.key)


def keeps_bits(c: MhcConfig, cur: MhcConfig) -> bool:
    """Only (kc, num_warps) set the mixes kernel's fp32 sums; nothing else changes a bit."""
    return (c.kc, c.num_warps) == (cur.kc, cur.num_warps)


def phase1(sh: Shape, cur: MhcConfig, allow_bit_changes: bool) -> list[MhcConfig]:
    dp = max(16, next_pow2(sh.D))
    half = max(16, dp // 2)
    out = [cur,
           replace(cur, finish_warps=1, block_d=min(dp, 1024)),
           replace(cur, finish_warps=2, block_d=dp),
           replace(cur, finish_warps=2, block_d=half),
           replace(cur, finish_warps=8, block_d=dp),
           replace(cur, finish_warps=16, block_d=dp),
           replace(cur, block_d=half),
           replace(cur, sinkhorn_apart=False),
           replace(cur, sinkhorn_apart=False, finish_warps=8, block_d=dp),
           replace(cur, block_m=4), replace(cur, block_m=16),
           replace(cur, post_block_d=256), replace(cur, post_block_d=1024),
           replace(cur, sinkhorn_scalar=True), replace(cur, sinkhorn_scalar=True, sinkhorn_apart=False)]
    if SMOKE:  # one of each kind
        out = [out[i] for i in (0, 1, 6, 7, 10, 11, 13)]
    if allow_bit_changes:
        out += [replace(cur, kc=128), replace(cur, kc=512), replace(cur, num_warps=2), replace(cur, num_warps=8)]
    out = [c for c in dict.fromkeys(out) if c.block_d <= dp and c.post_block_d <= dp]
    for c in out:
        c.check()
    return out[:MAX_CANDS]


def phase2(rows: list[dict], tried: list[MhcConfig], cur: MhcConfig) -> list[MhcConfig]:
    """One candidate: the best finish (block_d, finish_warps, sinkhorn_apart/_scalar), the best block_m
    and the best post_block_d of phase 1, each judged among the rows that vary only it."""
    ok = [r for r in rows if "score" in r and keeps_bits(r["cfg"], cur)]

    def fin(c):
        return (c.block_d, c.finish_warps, c.sinkhorn_apart, c.sinkhorn_scalar)

    def best(pred, key, what):
        rs = [r for r in ok if pred(r["cfg"])]
        return what(min(rs, key=lambda r: r[key])["cfg"]) if rs else what(cur)

    f = best(lambda c: (c.block_m, c.post_block_d) == (cur.block_m, cur.post_block_d), "pre_score", fin)
    bm = best(lambda c: fin(c) == fin(cur) and c.post_block_d == cur.post_block_d, "pre_score", lambda c: c.block_m)
    pd = best(lambda c: fin(c) == fin(cur) and c.block_m == cur.block_m, "post_score", lambda c: c.post_block_d)
    c = replace(cur, block_d=f[0], finish_warps=f[1], sinkhorn_apart=f[2], sinkhorn_scalar=f[3], block_m=bm,
                post_block_d=pd)
    return [] if c in tried else [c]


def short(c: MhcConfig) -> str:
    return (f"kc{c.kc} m{c.block_m} d{c.block_d} pd{c.post_block_d} w{c.num_warps} fw{c.finish_warps}"
            f"{' apart' if c.sinkhorn_apart else ' serial'}{' scalar' if c.sinkhorn_scalar else ''}")


# ---- parallel compilation -------------------------------------------------------------------------
def warm_worker(path: str, shard: int, shards: int) -> None:
    """Runs every shards-th candidate once at each batch size on one set of weights (the same
    specializations as the timed calls: the same shapes and strides)."""
    with open(path) as f:
        spec = json.load(f)
    device = spec["device"]
    inp = Inputs(model_shape(), device, copies=1)
    for i, c in enumerate(spec["jobs"]):
        if i % shards != shard:
            continue
        cfg = MhcConfig(**c)
        try:
            for B in BS:
                _, post, comb = inp.pre(B, cfg)
                inp.pp[B] = (post, comb)
                inp.head(B, cfg)
                inp.post(B, cfg)
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"warm error {short(cfg)}: {e!r}"[:600], flush=True)


def start_warm(jobs: list[MhcConfig], device: str, shards: int):
    """Starts the compile processes (bench_kernels.start_workers); returns a handle for finish_warm."""
    return BK.start_workers(__file__, dict(device=device, jobs=[asdict(c) for c in jobs]), len(jobs), shards, ("--smoke",) if SMOKE else ())


def finish_warm(handle, log) -> None:
    BK.finish_workers(handle, log)


# ---- the sweep ------------------------------------------------------------------------------------
def time_calls(fns) -> float:
    return BK.graph_time(fns, reps=REPS)[0]


def timings(inp: Inputs, B: int, cfg: MhcConfig) -> tuple[float, float, float]:
    """µs per call of mhc_pre, mhc_post, mhc_head at batch B, each call on its own weight copy."""
    n = len(inp.pre_w)
    pre = [lambda j=j: inp.pre(B, cfg, j) for j in range(n)]
    head = [lambda j=j: inp.head(B, cfg, j) for j in range(n)]
    post = [lambda: inp.post(B, cfg)] * n
    return time_calls(pre), time_calls(post), time_calls(head)


def measure(inp: Inputs, cfg: MhcConfig, cur: MhcConfig, ref_outs: dict, phase: int) -> dict:
    r = dict(cfg=cfg, config=short(cfg), phase=phase, current=cfg == cur, same_bits=keeps_bits(cfg, cur), ok=False,
             msg="", t1=None, t64=None)
    b1, bmax = BS[0], BS[-1]
    try:
        outs = {B: inp.outputs(B, cfg) for B in BS}
        if r["same_bits"]:
            bad = [f"B={B}: {d}" for B in BS if (d := same(outs[B], ref_outs[B]))]
            ok, msg = (False, "bits differ from the current configuration's: " + "; ".join(bad)) if bad else (True, "ok")
        else:
            ok, msg = check_ref(inp, bmax, outs[bmax])
            if ok and same(inp.outputs(bmax, cfg), outs[bmax]):
                ok, msg = False, "not deterministic"
            if ok and (d := same([t[:1] for t in outs[bmax]], outs[b1])):
                ok, msg = False, f"B=1 differs from row 0 of the batch ({d})"
        r.update(ok=ok, msg=msg)
        if not ok:
            return r
        for B in BS:
            tag = "1" if B == b1 else "64"
            r["pre" + tag], r["post" + tag], r["head" + tag] = timings(inp, B, cfg)
            r["t" + tag] = r["pre" + tag] + r["post" + tag]
    except Exception as e:  # noqa: BLE001
        r.update(ok=False, msg=f"raised {e!r}"[:300], t1=None, t64=None)
        traceback.print_exc(limit=-3)
    return r


def objective(rows: list[dict]) -> None:
    """score = t1 / best t1 + t64 / best t64 (and the same for pre and post alone, for phase 2)."""
    timed = [r for r in rows if r["ok"] and r.get("t1") is not None]
    if not timed:
        return
    for name, a, b in (("score", "t1", "t64"), ("pre_score", "pre1", "pre64"), ("post_score", "post1", "post64")):
        m1, m64 = min(r[a] for r in timed), min(r[b] for r in timed)
        for r in timed:
            r[name] = r[a] / m1 + r[b] / m64


def fmt_row(r: dict, winner: bool = False) -> str:
    t = (lambda v: f"{v:7.1f}" if v is not None else "      -")
    sc = f"{r['score']:6.3f}" if "score" in r else "     -"
    tag = ("*" if winner else " ") + ("c" if r["current"] else " ") + (" " if r["same_bits"] else "~")
    return (f"{tag} {r['config']:44s} {t(r.get('pre1'))} {t(r.get('post1'))} {t(r.get('head1'))} "
            f"{t(r.get('pre64'))} {t(r.get('post64'))} {t(r.get('head64'))} {sc}  "
            f"{'ok' if r['ok'] else 'FAIL ' + r['msg']}")


HEADER = (f"   {'config (* winner, c current, ~ other bits)':44s} {'pre1':>7s} {'post1':>7s} {'head1':>7s} "
          f"{'pre64':>7s} {'post64':>7s} {'head64':>7s} {'score':>6s}  check   [µs per call]")


def sweep(device, log=print, *, allow_bit_changes: bool = False, shards: int | None = None,
          table: list | None = None) -> dict[tuple[int, int], MhcConfig]:
    """Checks and times the candidates at B = 1 and B = 64 on `device` ("cuda" / a cuda device;
    "cpu" only with --smoke's settings, under the interpreter) -> {(hc, D): winner}. Every row
    (dicts: config, pre1, post1, head1, pre64, ..., score, ok, msg) is appended to `table` when
    given."""
    device = str(torch.device(device))
    cpu = device == "cpu"
    sh = model_shape()
    cur = current_config(sh)
    t0 = time.time()
    shards = shards or (1 if cpu else max(1, min(16, (os.cpu_count() or 8) - 1)))
    cands = phase1(sh, cur, allow_bit_changes)
    handle = start_warm(cands, device, shards)
    inp = Inputs(sh, device, 1 if SMOKE else COPIES)
    log(f"mhc: hc={sh.hc} D={sh.D} iters={sh.iters}, {len(inp.pre_w)} weight copies, B in {BS}; current {short(cur)}")
    if not cpu:  # the clocks up while the compiles run
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(100):
            x @ x
        torch.cuda.synchronize()
        del x
    finish_warm(handle, log)
    # the current configuration's outputs: the bits every same-bits candidate must give
    ref_outs = {}
    for B in BS:
        x, post, comb = inp.pre(B, cur)
        inp.pp[B] = (post, comb)
        ref_outs[B] = inp.outputs(B, cur)
    ok, msg = check_ref(inp, BS[-1], ref_outs[BS[-1]])
    if ok and same(inp.outputs(BS[-1], cur), ref_outs[BS[-1]]):
        ok, msg = False, "not deterministic"
    if ok and (d := same([t[:1] for t in ref_outs[BS[-1]]], ref_outs[BS[0]])):
        ok, msg = False, f"B=1 differs from row 0 of the batch ({d})"
    log(f"current configuration vs the refs, determinism, batch invariance: {msg}")
    if not ok:
        log("the current configuration fails its checks: nothing is pinned")
        return {}
    log(HEADER)
    rows = []
    for c in cands:
        rows.append(measure(inp, c, cur, ref_outs, 1))
        log(fmt_row(rows[-1]))
    objective(rows)
    more = phase2(rows, cands, cur)
    if more:  # its kernels are phase 1's (each kernel's compile depends on its own fields only)
        for c in more:
            rows.append(measure(inp, c, cur, ref_outs, 2))
            log(fmt_row(rows[-1]))
        objective(rows)
    ranked = sorted((r for r in rows if "score" in r), key=lambda r: (r["score"], r["config"]))
    winners = {sh.key: ranked[0]["cfg"]} if ranked else {}
    log("\n" + HEADER)
    for r in sorted(rows, key=lambda r: (r.get("score", math.inf), r["config"])):
        r["winner"] = bool(ranked) and r is ranked[0]
        log(fmt_row(r, r["winner"]))
    log(f"sweep: {time.time() - t0:.1f} s")
    log("\n# megastep/kernels/mhc.py, from benchmarks/kernels/tune_mhc.py on "
        f"{'cpu (smoke)' if cpu else torch.cuda.get_device_name(device)}:")
    log("_PINNED: dict[tuple[int, int], MhcConfig] = {")
    if ranked:
        w = ranked[0]
        c = next((r for r in rows if r["current"] and "score" in r), None)
        vs = f" (current {c['t1']:.1f} / {c['t64']:.1f})" if c else ""
        log(f"    {sh.key}: {w['cfg']!r},  # pre+post {w['t1']:.1f} / {w['t64']:.1f} us at B=1 / {BS[-1]}{vs}")
    log("}")
    if table is not None:
        table.extend({**{n: v for n, v in r.items() if n != "cfg"}, "cfg": asdict(r["cfg"])} for r in rows)
    return winners


def install(winners: dict[tuple[int, int], MhcConfig]) -> None:
    """Makes pick_config return the winners (mhc._PINNED) in this process."""
    for key, cfg in winners.items():
        cfg.check()
        M._PINNED[tuple(key)] = cfg


def smoke_settings() -> None:
    global BS, REPS, MAX_CANDS, SMOKE
    SMOKE = True
    BS, REPS, MAX_CANDS = (1, 3), 1, 8
    BK.DEV = "cpu"  # graph_time: eager calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    ap.add_argument("--json", help="write the table (and the winners) to this file")
    ap.add_argument("--allow-bit-changes", action="store_true",
                    help="also try kc / num_warps (other fp32 sums in the mixes kernel; checked against the refs)")
    BK.add_worker_arguments(ap)
    args = ap.parse_args()
    winners = BK.run_tuner(args, args.smoke, smoke_settings, warm_worker,
                           lambda device, table: sweep(device, allow_bit_changes=args.allow_bit_changes,
                                                       shards=args.shards, table=table),
                           install, M.pick_config)
    if winners is not None:
        print("winners:", winners)

if __name__ == "__main__":
    main()
