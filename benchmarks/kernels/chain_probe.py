"""A probe, not used by the runtime: what does a persistent launch buy a chain of weight streams at
one row? (chain_probe.cu; one H200, ~1-2 min a chain.)

Answered 2026-12-05 on one H100 (docs/PERFORMANCE.md, "2026-12-05 from 10:52 UTC"): nothing. Every
entry, persistent or a launch a layer, streamed below the step's Triton linears (hca4: 58.8 us for
Triton, 63.9 at best a launch a layer with PDL, 68.9 persistent; 50-59 % of the streaming read
against 60-65 %), and the chain was no faster than sep_pdl. Asked again 2026-12-06 with the step's own
Triton loop (`--tchain`: linear_chain.py, one H100): the same answer. On 2 programs per SM (4 could not
be resident: 149-209 registers a thread) the persistent chain was 25-50 % slower than linear_fp8's
launches (wo: 43.96 against 35.07 us), and as the step's wo_a -> wo_b on 4 per SM it took 35.1 us
against 34.1.

    python benchmarks/kernels/chain_probe.py [--out DIR] [--chain hca4|hca|wo|small] [--reps 20] [--gaps off,on]
        [--kinds KIND,...|none] [--tchain 1,2,4]

Why: at one row the FP8 linears on a layer's critical path stream at ~2.3 TB/s against 4.2-4.35
measured (docs/PERFORMANCE.md, twenty-eighth measurement: wq_b, wo_a and wo_b of an HCA sublayer,
33.5 MB each, close 13.7, 14.1 and 14.7 us). Every way of starting a launch's loads earlier tried so
far lost (its waiting CTAs take SMs from the launch before it), and each launch pays its own ramp
and tail. The step's notes name "a persistent launch per sublayer that streams the next weights while
the latency-bound work runs" as the structural lever, never measured. This measures its core on the
simplest case, before anyone builds it: the sublayer's weight streams back to back, with nothing
between them ("off") or with the latency-bound stages between them as waits of their measured length
("on": the RMS norm between the x group and wq_b, q norm + RoPE and the attention between wq_b and
wo_a; in one launch the waits stand for those stages inside a persistent sublayer).

What runs (x [1, K] fp32 in, y [N] fp32 out, layer l + 1 reading layer l's first G K values; the "hca4"
chain is an HCA sublayer's: the x group 1536 x 4096, wq_b 32768 x 1024, wo_a 8 groups of 1024 x 4096,
wo_b 4096 x 8192, 107 MB; "hca" the last three, "wo" the last two):
- triton: today's `linear_fp8`, one launch per layer, with the step's PDL settings (the stages:
  a one-program kernel spinning that long);
- sep: chain_probe.cu's kernel, one launch per layer (stream order);
- sep_pdl: the same with programmatic dependent launch: a layer's CTAs copy their first weight tiles
  as soon as an SM frees, before they wait for the previous layer;
- chain: ONE launch of the same kernel for all layers: a warp copies its next tasks' weights (the
  next layer's too) before it waits for a layer's input, so HBM need not idle between layers;
- sep xor / chain xor: the same launches with the arithmetic replaced by an XOR of the tiles (the
  floor of that structure: what the copies, waits and stores cost alone).
- bulk / bxor (added after that answer, `--kinds`): "tri" and "xor" with another loader. A warp's ring
  slot is filled by 16 cp.async.bulk copies (lane r copies row r's KC bytes; the rows KC + 16 bytes
  apart, so a "tri" read hits 32 banks without a swizzle) completing on the slot's mbarrier, instead of
  16-byte cp.async per lane in commit groups: the copy engine, not the warp's lanes, moves the bytes.
  The XOR-only entries were slower than the MMA ones, so the per-warp copies themselves looked like the
  bound; this asks whether the bulk engine lifts it (`bash benchmarks/h200_checks.sh bulk`). The rule
  set before it runs: if "sep_pdl bulk" beats the Triton launches by 5 % or more on hca4 and wo, a
  runtime FP8 linear for few rows gets this loader (wo_tail.cu's persistence, removed since: read it at
  4818dc0; or a launch a linear: the entries already have linear_fp8's bits); if even "bxor" (copies
  only) stays under Triton's rate, the loader is not what holds the 1-row linears and the loop direction
  ends here.
  Answered 2026-12-05 on one H100 (docs/PERFORMANCE.md, "2026-12-05 from 12:51 UTC"): no. The best bulk
  entry streamed at the cp.async ring's rate (hca4 65.06 against 63.78 us, wo 39.35 against 39.09; Triton
  58.05 and 35.27), so the loop direction ends. (The copy-only floors take K / KC splits, more split
  traffic than the MMA entries, and bound nothing: the rule's second clause was void.)
 - tchain / tsep (`--tchain`, added 2026-12-06: triton_chain.py, linear_chain.py): the
  same chain with the step's own Triton loop, in ONE persistent launch of P programs (tchain), and the
  same kernel a launch a layer (tsep); P is given as programs per SM. Every layer's y must have
  linear_fp8's bits (checked) and no wait may give up; only then is it timed. It separates what
  chain_probe.cu could not: the launch boundary against the loop.
The kernel's entries: "gemv" (its own K order inside a 128-block, that of the fastest CUDA loop
measured at one row, and a task of KC bytes of K) and "tri" (Triton's k16 column sets and
linear_fp8's own K splits: every output has linear_fp8's bits, checked, so such a launch could
replace the Triton linears at few rows without changing a bit), in several shapes (W warps per CTA,
R ring slots per warp, KC bytes of K per sub-tile).
sep, sep_pdl and chain of one entry do the same arithmetic in the same order, so they must give the
same bits (checked), and each layer's output must match `linear_fp8_ref` of its input (checked:
within 1e-5 of the sum of |products|).
Each call of a timed graph reads another copy of the weights (two copies, 2 x 100 MB > the 60 MB L2).
Prints a table last: us per chain, the same less the gaps, that as GB/s of the chain's weight bytes
and % of the streaming read measured in the same run (over 100 %: weights streamed during the
gaps); the full log and a JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from megastep.kernels.cuda_module import CudaModule  # noqa: E402

SOURCE = os.path.join(HERE, "chain_probe.cu")
SIGNATURE = "pippi"  # desc, layers, counters, err, pdl
# the .cu's entries (W warps, R ring slots, KC bytes of K per sub-tile) by kind: "gemv" its own K order
# (a task is one sub-tile), "tri" Triton's k16 sets and linear_fp8's splits (a task of at most
# TRI_XMAX bytes of K), "xor" the same launch without arithmetic
KINDS = {
    "gemv": ((8, 3, 512), (12, 2, 512), (16, 3, 256), (8, 6, 256), (16, 2, 256)),
    "tri": ((8, 3, 512), (16, 3, 256), (16, 2, 256)),
    "xor": ((8, 3, 512), (16, 3, 256)),
    # (KC 1024: one copy a row a split; not for the hca4 chain, whose x group takes 512 bytes a split)
    "bulk": ((8, 3, 512), (8, 6, 256), (16, 2, 256), (4, 6, 512), (4, 3, 1024), (6, 2, 1024)),
    "bxor": ((8, 3, 512), (16, 3, 256)),
}
TRI_KINDS = ("tri", "bulk")  # linear_fp8's splits and bits
XOR_KINDS = ("xor", "bxor")  # no arithmetic: nothing to check
BULK_KINDS = ("bulk", "bxor")  # the bulk-copy loader: rows KC + 16 bytes apart, an mbarrier per slot
TRI_XMAX = 1024  # the .cu's XMAX of CHAIN_TRI_ENTRY
DESC = 10  # the .cu's kDesc
MAX_LAYERS = 4  # kMaxLayers
MAX_TILES = 4096  # kMaxTiles
TILE_COUNTERS = 64  # kTileCounters
SMEM_LIMIT = 227 * 1024  # dynamic shared memory an H100 / H200 CTA may opt into
# name: layers (N, K, G, gap): layer l + 1 reads the first G_{l+1} K_{l+1} <= N_l values of layer l's y;
# gap (us), the latency-bound stage before the layer: from the twenty-eighth measurement's one-row HCA
# sublayer (medians), the x group's end to wq_b's start (the RMS norm) 2.7 us, wq_b's end to wo_a's
# start (q norm + RoPE, the attention) 13.8 us, wo_a's end to wo_b's start 0.3 us (a launch: none here)
CHAINS = {
    "hca4": ((1536, 4096, 1, 0.0), (32768, 1024, 1, 2.7), (8192, 4096, 8, 13.8), (4096, 8192, 1, 0.0)),
    "hca": ((32768, 1024, 1, 0.0), (8192, 4096, 8, 13.8), (4096, 8192, 1, 0.0)),
    "wo": ((8192, 4096, 8, 0.0), (4096, 8192, 1, 0.0)),
    # the GPU test's: 4 MB a layer, a grouped layer in the middle, linear_fp8 taking 256 bytes of K per split
    "small": ((4096, 1024, 1, 0.0), (8192, 512, 8, 2.0), (1024, 4096, 2, 0.0)),
}


def entry(w: int, r: int, kc: int, kind: str = "gemv") -> str:
    return f"chain_{kind}_w{w}_r{r}_kc{kc}"


def xmax(kc: int, kind: str) -> int:
    return TRI_XMAX if kind in TRI_KINDS else kc


def smem_bytes(w: int, r: int, kc: int, kind: str = "gemv") -> int:
    """The .cu's layout: W x R weight slots of 16 rows x KC bytes (KC + 16 with the bulk loader), then
    per warp XMAX fp16 x codes and 64 bytes of block scales, then the bulk loader's W x R mbarriers."""
    bulk = kind in BULK_KINDS
    return w * r * 16 * (kc + 16 * bulk) + w * (xmax(kc, kind) * 2 + 64) + 8 * w * r * bulk


def splits(layers, kc: int, kind: str) -> tuple[int, ...]:
    """The launch's split of each layer's K: linear_fp8's for "tri" (so its sums), else K / KC."""
    if kind in TRI_KINDS:
        from megastep.kernels import linear_fp8 as LIN
        return tuple(LIN.pick_config(1, N, K).split_k for N, K, *_ in layers)
    return tuple(K // kc for _, K, *_ in layers)


def check_chain(layers: tuple[tuple[int, int, int, float], ...], kc: int, kind: str = "gemv") -> None:
    """The shapes the kernel takes with KC bytes per sub-tile; a ValueError says what does not fit."""
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"a chain has 1..{MAX_LAYERS} layers, got {len(layers)}")
    for i, ((N, K, G, _), S) in enumerate(zip(layers, splits(layers, kc, kind))):
        if N % 16 or N // 16 > MAX_TILES or G < 1 or N % G or (N // G) % 16:
            raise ValueError(f"layer {i}: N {N} must be a multiple of 16 (of 16 G per group), at most {16 * MAX_TILES}")
        if S < 1 or K % S or (K // S) % kc or K // S > xmax(kc, kind):
            raise ValueError(f"layer {i}: K {K} in {S} splits must be a multiple of KC {kc}, each split at most "
                             f"{xmax(kc, kind)}")
        if i and G * K > layers[i - 1][0]:
            raise ValueError(f"layer {i} reads {G} x {K} inputs but layer {i - 1} writes {layers[i - 1][0]}")


def fits(layers, kc: int, kind: str) -> bool:
    try:
        check_chain(layers, kc, kind)
        return True
    except ValueError:
        return False


def chain_bytes(layers) -> int:
    return sum(N * K + (N // 128) * (K // 128) for N, K, *_ in layers)


def gaps_us(layers, on: bool) -> list[float]:
    """The latency-bound stage before each layer, us (all 0 when off)."""
    return [gap if on else 0.0 for *_, gap in layers]


@dataclass
class Layer:
    w: torch.Tensor  # e4m3 [N, K]
    ws: torch.Tensor  # e8m0 [N/128, K/128]
    G: int


class Chain:
    """One copy of a chain's weights and buffers, launched by any of the kernel's entries."""

    def __init__(self, layers, gen: torch.Generator, device="cuda"):
        self.shapes = layers
        self.layers = []
        import bench_kernels as BK
        for N, K, G, _ in layers:
            self.layers.append(Layer(*BK.fp8_weight(N, K, gen, device), G))
        self.x0 = torch.randn(layers[0][2] * layers[0][1], device=device, generator=gen)
        self.ys = [torch.empty(N, device=device) for N, *_ in layers]
        self.parts = [torch.empty(K // 128 * N, device=device) for N, K, *_ in layers]  # enough for any split
        self._descs: dict[tuple[tuple[int, ...], bool], torch.Tensor] = {}  # (splits, gaps on)
        # one counter block per launch of a "sep" run, so a PDL launch never touches its predecessor's
        self.counters = torch.zeros(len(layers), TILE_COUNTERS + MAX_LAYERS * MAX_TILES, dtype=torch.int32,
                                    device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def desc(self, kc: int, kind: str, gaps: bool) -> torch.Tensor:
        """The layers' descriptors for an entry (the .cu's kDesc fields), made once per split set and
        gaps on / off."""
        key = (splits(self.shapes, kc, kind), gaps)
        if key not in self._descs:
            self._descs[key] = torch.tensor([v for i, ((N, K, G, _), S, gap) in enumerate(
                zip(self.shapes, key[0], gaps_us(self.shapes, gaps))) for v in (
                self.layers[i].w.data_ptr(), self.layers[i].ws.data_ptr(),
                (self.x0 if i == 0 else self.ys[i - 1]).data_ptr(), self.ys[i].data_ptr(), self.parts[i].data_ptr(),
                N, K, G, S, round(gap * 1000))], dtype=torch.int64, device=self.x0.device)
        return self._descs[key]

    def x(self, i: int) -> torch.Tensor:
        """Layer i's input [1, G K]: x0, or the first G K values of the layer before's output."""
        ly = self.layers[i]
        return (self.x0 if i == 0 else self.ys[i - 1][:ly.G * ly.w.shape[1]])[None]

    def launch(self, module: CudaModule, shape: tuple[int, int, int], mode: str, gaps: bool = False,
               sms: int | None = None, kind: str = "gemv") -> None:
        """mode "chain": one launch for every layer; "sep" / "sep_pdl": one launch per layer, each with
        its own counters, plain or with PDL. gaps: the latency-bound stages before the layers as waits
        (CHAINS). One CTA per SM (sms: the device's count). kind: the entry's (KINDS)."""
        w, r, kc = shape
        k = module.kernel(entry(w, r, kc, kind), SIGNATURE)
        sms = sms or torch.cuda.get_device_properties(self.x0.device).multi_processor_count
        smem = smem_bytes(w, r, kc, kind)
        desc = self.desc(kc, kind, gaps)
        if mode == "chain":
            k.launch((sms, 1, 1), (32 * w, 1, 1), smem, None, desc, len(self.layers), self.counters[0], self.err, 0)
            return
        pdl = mode == "sep_pdl"
        for i in range(len(self.layers)):
            k.launch((sms, 1, 1), (32 * w, 1, 1), smem, None, desc.data_ptr() + 8 * DESC * i, 1,
                     self.counters[i], self.err, int(pdl), pdl=pdl)

    def triton(self, gaps: bool = False, spin=None) -> torch.Tensor:
        """The same chain through today's FP8 linear, one launch per layer (for its time only); with
        gaps, a one-program kernel spinning for each stage (spin(ns)) before its layer."""
        from megastep.kernels import linear_fp8 as LIN
        y = None
        for i, (ly, gap) in enumerate(zip(self.layers, gaps_us(self.shapes, gaps))):
            if gap:
                spin(round(gap * 1000))
            x = self.x0[None] if i == 0 else y[:, :ly.G * ly.w.shape[1]]
            y = LIN.linear_fp8(x, ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G)
        return y

    def check_linear_fp8_bits(self, name: str) -> None:
        """Each layer's y against linear_fp8 of the input it read, bit for bit; raises AssertionError."""
        from megastep.kernels import linear_fp8 as LIN
        for i, ly in enumerate(self.layers):
            ref = LIN.linear_fp8(self.x(i), ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G)[0]
            if not torch.equal(ref, self.ys[i]):
                n = int((ref != self.ys[i]).sum())
                raise AssertionError(f"{name}: layer {i} differs from linear_fp8 in {n} of {ref.numel()} outputs")

    def check(self, tol: float = 1e-5) -> float:
        """Each layer's y against linear_fp8_ref of the input it read; returns the largest error
        relative to the sum of |products| of its element. Raises when over tol."""
        from megastep.checkpoint import formats
        from megastep.kernels import linear_fp8 as LIN
        worst = 0.0
        for i, ly in enumerate(self.layers):
            x = self.x(i)
            ref = LIN.linear_fp8_ref(x, ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G)[0]
            xq = formats.fp8_act_sim(x.float(), 128).abs()
            wd = formats.dequantize_fp8_weight(ly.w, ly.ws, 128).abs()
            N, K = ly.w.shape
            bound = torch.einsum("gk,gnk->gn", xq.view(ly.G, K), wd.view(ly.G, N // ly.G, K)).reshape(N)
            err = ((self.ys[i] - ref).abs() / bound.clamp_min(1e-30)).max().item()
            worst = max(worst, err)
            if not err <= tol:
                raise AssertionError(f"layer {i}: error {err:.3e} of the |products| sum (tolerance {tol:.0e})")
        return worst


def check_shape(module: CudaModule, chain: Chain, shape, log, kind: str = "gemv") -> None:
    """One entry: every mode checked against the ref; sep, sep_pdl and chain (without and with the
    chain's gaps) the same bits, run to run too; no spin gave up (all CTAs resident); "tri" also
    linear_fp8's bits, layer by layer. Raises AssertionError."""
    name = entry(*shape, kind)
    outs = {}
    for mode, gaps in (("sep", False), ("sep_pdl", True), ("chain", False), ("chain", True)):
        for y in chain.ys:
            y.fill_(float("nan"))
        chain.err.zero_()
        chain.launch(module, shape, mode, gaps, kind=kind)
        torch.cuda.synchronize()
        if chain.err.item():
            raise AssertionError(f"{name} {mode}: a warp gave up waiting for layer {chain.err.item() - 1} "
                                 "(not all CTAs resident?)")
        err = chain.check()
        key = mode if mode not in outs else mode + "2"
        outs[key] = [y.clone() for y in chain.ys]
        log(f"{name} {mode}: ok, largest error {err:.2e} of the |products| sum")
    for key in ("sep_pdl", "chain", "chain2"):
        for i, (a, b) in enumerate(zip(outs["sep"], outs[key])):
            if not torch.equal(a, b):
                raise AssertionError(f"{name}: {key} differs from sep in layer {i}")
    log(f"{name}: sep, sep_pdl, chain (without and with the gaps) give the same bits")
    if kind in TRI_KINDS:
        chain.check_linear_fp8_bits(name)
        log(f"{name}: every layer has linear_fp8's bits")


def run_checks(module: CudaModule, chain: Chain, entries, log) -> list:
    """check_shape for each (kind, shape); returns those that passed (a failure is logged, not raised,
    so that one wrong entry does not cost the call the others' times)."""
    passed = []
    for kind, shape in entries:
        try:
            check_shape(module, chain, shape, log, kind)
            passed.append((kind, shape))
        except AssertionError as e:
            log(f"FAILED {e}")
    return passed


def check_tchains(copies, per_sm, log) -> list:
    """triton_chain.TritonChain for each copy at each programs-per-SM count, checked before any timing:
    every layer's y with linear_fp8's bits in both modes, no wait gave up, the counters back at zero.
    Returns [(name, [one per copy])] of those that passed; a failure is logged, not raised."""
    import linear_chain as LC
    import triton_chain as TC
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for k in per_sm:
        name = f"P={k * sms} ({k} per SM)"
        try:
            tcs = [TC.TritonChain(c, k * sms) for c in copies]
            tcs[0].lc.programs = 1  # compile with one program (no waits), then refuse what cannot be resident
            tcs[0].launch("chain")
            torch.cuda.synchronize()
            compiled = tcs[0].lc.compiled
            most = LC.max_programs(compiled, sms)
            log(f"tchain: {compiled.n_regs} registers, {compiled.metadata.shared} B shared, {most} programs resident "
                "at most")
            if k * sms > most:
                raise AssertionError(f"{name}: more programs than can be resident ({most})")
            tcs[0].lc.programs = k * sms
            for tc, c in zip(tcs, copies):
                for mode in ("chain", "sep", "chain"):
                    for y in c.ys:
                        y.fill_(float("nan"))
                    tc.launch(mode, [1.0] * len(c.layers) if mode == "chain" else None)
                    torch.cuda.synchronize()
                    lc = tc.lc
                    if lc.exit[1].item() or lc.exit[0].item() or lc.chunks.any().item():
                        raise AssertionError(f"{name} {mode}: a wait gave up, or the counters were not reset "
                                             f"(exit {lc.exit.tolist()}, chunks {int(lc.chunks.sum())})")
                    c.check_linear_fp8_bits(f"{name} {mode}")
            log(f"tchain {name}: chain (with 1 us gaps), sep, chain again: every layer has linear_fp8's bits")
            out.append((name, tcs))
        except AssertionError as e:
            log(f"FAILED {e}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/chain_probe"))
    ap.add_argument("--chain", default="hca4", choices=sorted(CHAINS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gaps", default="off,on", help="the latency-bound stages between the layers as waits (CHAINS)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the entries' kinds to check and time (KINDS), or none")
    ap.add_argument("--tchain", default="", help="triton_chain.py's persistent launch with these programs per SM "
                    "(e.g. 1,2,4), and a launch a layer of its kernel")
    args = ap.parse_args(argv)
    if not set(args.gaps.split(",")) <= {"off", "on"}:
        ap.error(f"--gaps takes off and / or on, got {args.gaps!r}")
    kinds = [] if args.kinds == "none" else args.kinds.split(",")
    if not set(kinds) <= set(KINDS) or (not kinds and args.kinds != "none"):
        ap.error(f"--kinds takes some of {', '.join(KINDS)} or none, got {args.kinds!r}")
    try:
        per_sm = [int(v) for v in args.tchain.split(",")] if args.tchain else []
    except ValueError:
        per_sm = [0]
    if any(v < 1 for v in per_sm):
        ap.error(f"--tchain takes programs per SM >= 1, e.g. 1,2,4; got {args.tchain!r}")
    import bench_kernels as BK
    from megastep.kernels import common
    from megastep.kernels.spin import _spin_kernel

    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "chain_probe.log"), "w")
    module = CudaModule(SOURCE) if kinds else None
    layers = CHAINS[args.chain]
    entries = [(kind, s) for kind in kinds for s in KINDS[kind] if fits(layers, s[2], kind)]
    for kind, s in entries:
        assert smem_bytes(*s, kind) <= SMEM_LIMIT, (kind, s)
        a = module.kernel(entry(*s, kind), SIGNATURE).attributes()
        BK.log(f"{entry(*s, kind)}: {a['num_regs']} registers, {a['local_size_bytes']} B local, "
               f"{smem_bytes(*s, kind)} B shared; splits {splits(layers, s[2], kind)}")
    bw = BK.measure_bandwidth()
    nbytes = chain_bytes(layers)
    BK.log(f"device {torch.cuda.get_device_name(0)}; streaming read {bw['read']:.0f} GB/s; chain {args.chain} "
           f"{layers}: {nbytes / 1e6:.1f} MB of weights, {nbytes / bw['read'] / 1e3:.2f} us at that rate")

    # the checks (the xor entries have no values to check): on the small chain where it fits, then on
    # the timed chain; only what passed both is timed
    gen = torch.Generator(device="cuda").manual_seed(0)
    small = CHAINS["small"]
    checked = [e for e in entries if e[0] not in XOR_KINDS]
    ok = set(run_checks(module, Chain(small, gen), [e for e in checked if fits(small, e[1][2], e[0])], BK.log))
    ok |= {e for e in checked if not fits(small, e[1][2], e[0])}
    copies = [Chain(layers, gen) for _ in range(2)]
    ok = set(run_checks(module, copies[0], [e for e in checked if e in ok], BK.log))
    entries = [e for e in entries if e in ok or e[0] in XOR_KINDS]
    tchains = check_tchains(copies, per_sm, BK.log)

    rows = []
    spin_out = torch.empty(1, dtype=torch.int64, device="cuda")

    def spin(ns: int) -> None:
        _spin_kernel[(1,)](spin_out, ns)

    def timed(name: str, gaps: bool, fn) -> None:
        gap_us = sum(gaps_us(layers, gaps))
        # once eagerly first: a launch whose warps gave up waiting (CTAs not all resident) is reported
        # and skipped, not replayed for minutes
        for c in copies:
            c.err.zero_()
            fn(c)
        torch.cuda.synchronize()
        if any(c.err.item() for c in copies):
            BK.log(f"{name}: a warp gave up waiting for a layer's input; not timed")
            rows.append({"variant": name, "gap_us": gap_us, "error": "gave up waiting"})
            return
        us, best = BK.graph_time([lambda c=c: fn(c) for _ in range(5) for c in copies], reps=args.reps)
        stream_us = us - gap_us  # the chain's time less its latency-bound stages
        rows.append({"variant": name, "gap_us": gap_us, "us": us, "best_us": best, "stream_us": stream_us,
                     "gb_s": nbytes / stream_us / 1e3, "pct_read": 100 * nbytes / stream_us / 1e3 / bw["read"]})
        BK.log(f"{name}, gaps of {gap_us:g} us in all: {us:.2f} us per chain (best {best:.2f}); less the gaps "
               f"{stream_us:.2f} us, {nbytes / stream_us / 1e3:.0f} GB/s")

    for gaps in [{"off": False, "on": True}[v] for v in args.gaps.split(",")]:
        old = common.set_pdl(True)  # the step's launch settings at one row
        try:
            timed("triton (the step's linear_fp8)", gaps, lambda c, gaps=gaps: c.triton(gaps, spin))
        finally:
            common.set_pdl(old)
        for name, tcs in tchains:
            for mode in ("sep", "chain"):
                if mode == "sep" and name != tchains[0][0]:
                    continue  # a launch a layer takes as many programs as the layer has items, whatever P
                timed(f"t{mode} {name}" if mode == "chain" else "tsep (triton_chain, a launch a layer)", gaps,
                      lambda c, tcs=tcs, mode=mode, gaps=gaps: tcs[copies.index(c)].launch(
                          mode, gaps_us(layers, gaps)))
        for kind, s in entries:
            for mode in ("sep", "chain") if kind in XOR_KINDS else ("sep", "sep_pdl", "chain"):
                timed(f"{mode} {kind} w{s[0]} r{s[1]} kc{s[2]}", gaps,
                      lambda c, s=s, mode=mode, gaps=gaps, kind=kind: c.launch(module, s, mode, gaps, kind=kind))

    with open(os.path.join(args.out, "chain_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "bandwidth": bw, "chain": args.chain,
                   "layers": layers, "bytes": nbytes, "rows": rows}, f, indent=1)
    BK.log(f"\n| variant | gaps (us) | us per chain | less the gaps | GB/s | % of the streaming read "
           f"({bw['read']:.0f} GB/s) |")
    BK.log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            BK.log(f"| {r['variant']} | {r['gap_us']:g} | {r['error']} | | | |")
        else:
            BK.log(f"| {r['variant']} | {r['gap_us']:g} | {r['us']:.2f} | {r['stream_us']:.2f} | {r['gb_s']:.0f} | "
                   f"{r['pct_read']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
