"""`megastep bench`: decode-step latency of the fast path against the memory roofline and a peer.

Method (docs/PERFORMANCE.md quotes it):
- Weights: a synthetic checkpoint in the official formats, generated in device memory.
- Context: every row's state (window ring, compressed KV, index keys, compressor buffers) is
  filled with random values and every row sits at position `context`, so each step reads what
  a real step at that context reads (attention cost depends on shapes, not values).
- Step time: one CUDA graph per batch size, replayed `iters` times after warm-up, each replay
  timed with CUDA events; p50/p90/p99 over replays.
- Roofline: bytes a step must read (all dense weights of the layers, the routed experts the rows
  touch, the head, the state read by attention) over the streaming read bandwidth measured in
  the same run. Routed experts: the expected distinct experts per step under the routing of the
  synthetic gates themselves (`routing.profile_from_random_activations`), split into HBM and
  host experts by the placement; host bytes count at the host-read bandwidth measured in the
  same run (a kernel reading page-locked memory through its device address), so with cold
  experts the roofline is the modeled limit HBM bytes / HBM bandwidth + host bytes / host-link
  bandwidth. Next to it, the routed experts the measured rows read (a few eager steps of the same
  rows with the decoder's route log on) and the roofline with those reads: one sequence's routing
  is one draw, not the expectation, and with cold experts each one read is a host-link transfer.
- Peer: transformers' DeepseekV4ForCausalLM at the same width with a few layers, bf16, on the
  same synthetic weights (dequantized), cached decode at the same context, per layer.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import re
import statistics
import time

import torch

from megastep.checkpoint.synthetic import LazyDeviceWeights, preset, synthesize_on_device
from megastep.config import CSA_RATIO, ModelConfig
from megastep.errors import AUTO, UserError, budget_arg, check_output_file, comma_ints, writing
from megastep.kernels import moe_lut, route_cuda
from megastep.runtime import distributed as D
from megastep.runtime.bandwidth import (cpu_read_bandwidth, host_read_bandwidth, hybrid_cpu_share,
                                        stream_read_bandwidth)
from megastep.runtime.experts import GB, auto_budget_bytes


# the weights a head-split attention divides over the ranks (FastDecoder(attn_split=True))
_HEAD_SPLIT = re.compile(r"\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$")


def step_bytes(cfg: ModelConfig, weights_bytes: dict[str, int], rows: int, context: int,
               placement=None, reads: tuple[float, float] | None = None) -> dict[str, float]:
    """Bytes one step must read, by part. weights_bytes: bytes per tensor name. `placement`
    (runtime.experts.Placement, with the routing shares of the run) gives the expected distinct
    routed experts in HBM and in host memory; without it, uniform routing, all in HBM. `reads`:
    (HBM, host) routed experts counted instead of expected (`routed_reads`)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    dense = 0
    head = 0
    per_expert = 0
    for name, nb in weights_bytes.items():
        if ".ffn.experts." in name:
            per_expert += nb
        elif name in ("head.weight",):
            head += nb
        elif name == "embed.weight":
            dense += rows * cfg.hidden_size * 2
        else:
            dense += nb
    per_expert /= E * cfg.num_hidden_layers
    if reads is not None:
        hot, cold = reads
    elif placement is None:
        hot, cold = cfg.num_hidden_layers * E * (1 - (1 - k / E) ** rows), 0.0
    else:
        hot, cold = placement.expert_reads_per_step(rows)
    state = 0.0
    for L in range(cfg.num_hidden_layers):
        r = cfg.ratio(L)
        state += rows * cfg.sliding_window * cfg.head_dim * 2
        if r == CSA_RATIO:
            n = context // r
            state += rows * (min(cfg.index_topk, n) * cfg.head_dim * 2 + n * cfg.index_head_dim * 2)
        elif r:
            state += rows * (context // r) * cfg.head_dim * 2
    experts, host = hot * per_expert, cold * per_expert
    return {"dense": dense, "routed_experts": experts, "head": head, "state": state,
            "total": dense + experts + head + state, "host_experts": host,
            "hot_experts_per_step": hot, "cold_experts_per_step": cold}


def fill_state(dec, context: int, seed: int = 0) -> None:
    """Random finite state for every slot, as if `context` tokens had been decoded."""
    g = torch.Generator(device=dec.device).manual_seed(seed)
    P = dec.pools
    for lst in (P.win, P.cent, P.ikeys, P.ckv, P.csc, P.ikv, P.isc):
        for t in lst:
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype))


def _tokens(rows: int, dev: torch.device) -> torch.Tensor:
    """The rows' token ids: drawn from a fixed seed, so that every run, and every rank of an
    expert-parallel run, decodes the same rows (each device's default generator is in its own state)."""
    return torch.randint(0, 1000, (rows,), generator=torch.Generator().manual_seed(rows)).to(dev)


def _rows(dev: torch.device, rows: int, context: int, block: int):
    """(tokens, positions, slots) of `rows` rows: rows // block sequences, each a block of `block`
    consecutive positions from `context` on (block 1: independent sequences)."""
    r = torch.arange(rows, device=dev)
    return _tokens(rows, dev), context + r % block, r // block


def time_graph(runner, rows: int, context: int, iters: int, warmup: int = 5, block: int = 1) -> list[float]:
    """Step times (ms) of `rows` rows (`_rows`), one CUDA-graph replay each."""
    b = runner.load(*_rows(runner.device, rows, context, block))
    for _ in range(warmup):
        runner.replay(b)
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        runner.replay(b)
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1))
    return out


def timeline_graph(runner, rows: int, context: int, block: int = 1) -> list[dict]:
    """The device timeline of one graph replay of time_graph's rows (runtime.trace.replay_timeline)."""
    from megastep.runtime.trace import replay_timeline

    b = runner.load(*_rows(runner.device, rows, context, block))
    runner.replay(b)  # warm
    return replay_timeline(lambda: runner.replay(b), runner.device)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def trace_step(dec, rows: int, context: int, repeats: int = 3,
               block: int = 1) -> tuple[dict[str, float], dict[int, float], float]:
    """Eager step with per-stage events (µs, averaged over repeats) and its own wall time (ms)."""
    from megastep.runtime.trace import StepTrace

    dev = dec.device
    tokens, pos, slots = _rows(dec.device, rows, context, block)
    dec.step(tokens, pos, slots, block=block)  # warm
    tr = StepTrace(dev)
    dec.trace = tr
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dec.step(tokens, pos, slots, block=block)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / repeats * 1e3
    dec.trace = None
    by_stage, by_layer = tr.summary()
    return ({k: v / repeats for k, v in by_stage.items()}, {k: v / repeats for k, v in by_layer.items()}, wall)


def routed_reads(dec, placement, rows: int, context: int, block: int = 1, steps: int = 3) -> dict:
    """The routed experts time_graph's rows actually read: `steps` eager steps of those rows with
    the decoder's route log on, and in each the distinct (layer, expert) pairs, counted by where
    `placement` keeps them (HBM: hot, host memory: cold); with them the passes the "lut" experts
    kernels make over those experts' weights (`expert_passes`): gate-up's (8 pairs a pass with
    moe_lut.GATE_UP_GM), and down's (8 with moe_lut.DOWN_GM, else wider from DOWN4_MIN_ROWS rows on)."""
    tokens, pos, slots = _rows(dec.device, rows, context, block)
    down_width = moe_lut.down_pairs_per_pass(rows * block, dec.device, dec.cfg.moe_intermediate_size)
    width = moe_lut.gate_up_pairs_per_pass(dec.device, dec.cfg.hidden_size)
    hot, cold, passes, down_passes, most = [], [], [], [], []
    for _ in range(steps):
        dec.route_log = []
        try:
            dec.step(tokens, pos, slots, block=block)
        finally:
            log, dec.route_log = dec.route_log, None
        counts = collections.Counter((L, e) for L, idx in log for e in idx.flatten().tolist())
        n_cold = sum(not placement.is_hot(L, e) for L, e in counts)
        hot.append(len(counts) - n_cold)
        cold.append(n_cold)
        passes.append(expert_passes(counts.values(), width))
        down_passes.append(expert_passes(counts.values(), down_width))
        most.append(max(counts.values(), default=0))
    return {"steps": steps, "hot_per_step": hot, "cold_per_step": cold, "passes_per_step": passes,
            "down_passes_per_step": down_passes, "down_pairs_per_pass": down_width, "pairs_per_pass": width,
            "most_pairs": most}


def expert_passes(pairs_per_expert, per_pass: int = moe_lut.PAIRS_PER_PASS) -> int:
    """The passes the "lut" experts kernels make over the weights of experts with these pair counts:
    an item streams its rows once for every `per_pass` of the expert's pairs (the kernels':
    moe_lut.PAIRS_PER_PASS), so an expert that 5 rows route to is streamed 3 times (the pair-major kernels'
    passes: gate-up's, and down's below moe_lut.DOWN4_MIN_ROWS rows, from there on passes of 4; the
    group-major kernels' take moe_lut.GM_PAIRS). Against the experts read it says
    how much of a step's expert work grows with the rows rather than with the bytes."""
    return sum(-(-c // per_pass) for c in pairs_per_expert)


def trace_kernels(dec, rows: int, context: int, block: int = 1) -> dict[str, dict[str, float]]:
    """Per stage: the summed device time of its kernels (µs) and their count, one eager step
    under the profiler (runtime.trace.kernel_summary)."""
    from megastep.runtime.trace import StepTrace, kernel_summary

    dev = dec.device
    tokens, pos, slots = _rows(dec.device, rows, context, block)
    dec.step(tokens, pos, slots, block=block)  # warm
    dec.trace = StepTrace(dev, ranges=True)
    try:
        return kernel_summary(lambda: dec.step(tokens, pos, slots, block=block), dev)
    finally:
        dec.trace = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Dequantized(dict):
    """name -> floating value of an official-format weight dict, dequantized on access."""

    def __init__(self, weights: dict[str, torch.Tensor], block: int):
        super().__init__({n: None for n in weights if not n.endswith(".scale")})
        self._w, self._block = weights, block

    def __getitem__(self, name: str) -> torch.Tensor:
        from megastep.checkpoint import formats

        t = self._w[name]
        if t.dtype == torch.float8_e4m3fn:
            return formats.dequantize_fp8_weight(t, self._w[name[:-7] + ".scale"], self._block)
        if t.dtype == torch.int8:
            return formats.dequantize_mxfp4_weight(t, self._w[name[:-7] + ".scale"])
        return t


def peer_transformers(cfg: ModelConfig, seed: int, device: torch.device, context: int, iters: int,
                      impls=("batched_mm", "grouped_mm", "eager")) -> dict:
    """transformers' DeepseekV4ForCausalLM (bf16) on the same synthetic weights as the fast path
    (first cfg.num_hidden_layers layers, same seed and device), cached greedy decode at
    `context`; ms per step and per layer for each experts implementation."""
    import transformers

    from megastep.model.hf_names import hf_config, load_official_into_hf

    weights = synthesize_on_device(cfg, seed, device)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # modules that pin fp32 (mHC, norms, sinks) keep it
    try:
        with torch.device(device):
            model = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(prev)
    load_official_into_hf(model, _Dequantized(weights, cfg.fp8_block))
    del weights
    res: dict[str, object] = {}
    ids = torch.randint(0, 1000, (1, context), device=device)
    for impl in impls:
        try:
            with torch.no_grad():
                # prefill with the per-expert loop: batched_mm gathers a weight copy per token
                model.config._experts_implementation = "eager"
                out = model(ids, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
                model.config._experts_implementation = impl
                ts = []
                for i in range(iters + 3):
                    _sync(device)
                    t0 = time.perf_counter()
                    out = model(tok, cache=cache, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
                    _sync(device)
                    if i >= 3:
                        ts.append((time.perf_counter() - t0) * 1e3)
            res[impl] = statistics.median(ts)
        except Exception as e:  # an implementation this transformers build lacks
            res[impl] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ok = {k: v for k, v in res.items() if isinstance(v, float)}
    best = min(ok, key=ok.get) if ok else None
    return {"layers": cfg.num_hidden_layers, "ms_per_step": res, "best_impl": best,
            "ms_per_layer": ok[best] / cfg.num_hidden_layers if best else None}


_AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # --pdl, --shared-after-router, --*-split -> FastDecoder's


def _batches(text: str) -> list[int]:
    """--batch: comma-separated row counts, each at least 1, ascending without repeats."""
    problem = f"--batch must be comma-separated row counts >= 1 (e.g. 1,4,16,64), got {text!r}"
    rows = sorted(set(comma_ints(text, problem)))
    if not rows or rows[0] < 1:
        raise UserError(problem)
    return rows


def _check_args(args: argparse.Namespace, batches: list[int]) -> ModelConfig:
    """Refuse bad arguments in one message each; the run's config (the preset first: a typo is named on a
    machine without the device too)."""
    cfg = preset(args.preset, layers=args.layers)
    if args.json:
        check_output_file(args.json, "--json")
    if args.block < 1 or any(b % args.block for b in batches):
        raise UserError(f"--block {args.block}: every batch must be a multiple of it (rows = sequences x block)")
    if args.gpus and (args.hbm_budget is not None or args.peer_layers):
        raise UserError("--gpus runs every expert in HBM across the GPUs: drop --hbm-budget / --peer-layers")
    for flag, what in (("attn_split", "the attention's heads"), ("vocab_split", "the lm head's vocabulary")):
        if getattr(args, flag) == "on" and not (args.gpus and len(D.parse_gpus(args.gpus)) > 1):
            raise UserError(f"--{flag.replace('_', '-')} on splits {what} over GPUs: give two or more with --gpus")
    if not torch.cuda.is_available():
        raise UserError("megastep bench needs a CUDA device")
    return cfg


@dataclasses.dataclass
class BenchSetup:
    """What a run sets up once before it times any step (`setup`): the decoder on its weights, its
    bytes, placement and the bandwidths measured in the run."""
    cfg: ModelConfig
    dec: object  # model.fast.FastDecoder
    batches: list[int]
    world_size: int
    wbytes: dict[str, int]
    split_bytes: int  # of the weights a head-split attention divides over the ranks
    placement: object  # runtime.experts.Placement
    host_bw: float | None
    cpu_bw: float | None
    cpu_share: float | None
    gen_s: float
    bw: float  # the device's streaming read, GB/s
    cold_bw: float | None  # the cold bytes' path, GB/s
    peer: dict | None  # peer_transformers' line (--peer-layers, one GPU)
    budget_gb: float | None  # --hbm-budget, "auto" resolved
    free_at_start: int  # the device's free bytes before the weights were built

    def runner(self, args: argparse.Namespace):
        """A StepRunner of fresh CUDA graphs (captured at their first replay) for the batches."""
        from megastep.runtime.step import StepRunner

        step = self.dec.step if args.block == 1 else functools.partial(self.dec.step, block=args.block)
        return StepRunner(step, self.dec.device, self.dec.pools.dummy_slot, buckets=self.batches)


def setup(args: argparse.Namespace, rank=None) -> BenchSetup:
    """Check the arguments, run the transformers peer (--peer-layers), build the decoder on synthetic
    weights with every row's state filled at `--context`, and measure the bandwidths of the roofline
    (rank: as in run_bench)."""
    from megastep.model.fast import FastDecoder

    batches = _batches(args.batch)
    cfg = _check_args(args, batches)
    dev = rank.device if rank is not None else torch.device("cuda")
    W = rank.world_size if rank is not None else 1
    if args.moe_mode == "lut" and not moe_lut.supported(dev, torch.bfloat16, cfg.hidden_size,
                                                         cfg.moe_intermediate_size):
        raise UserError(f"--moe-mode lut needs nvcc and hidden / moe intermediate sizes that are multiples of 512 "
                        f"(preset {args.preset}: {cfg.hidden_size} / {cfg.moe_intermediate_size})")
    if args.router == "cuda" and not route_cuda.supported(dev, cfg.n_routed_experts, cfg.hidden_size,
                                                           cfg.num_experts_per_tok):
        raise UserError(f"--router cuda needs nvcc, a multiple of 32 experts up to {route_cuda.MAX_EXPERTS} and a "
                        f"hidden size that is a multiple of 128 (preset {args.preset})")
    peer = None
    if args.peer_layers and W == 1:  # first, while the device is empty: it needs bf16 copies of its layers
        peer = peer_transformers(preset(args.preset, layers=args.peer_layers), args.seed, dev, args.context, iters=10)
    torch.cuda.synchronize()
    free_at_start = torch.cuda.mem_get_info(dev)[0]
    max_ctx = args.context + 128  # the state pools' context: every row sits at --context
    budget_gb = args.hbm_budget
    if budget_gb == AUTO:
        budget_gb = auto_budget_bytes(cfg, dev, max_seqs=max(batches), max_ctx=max_ctx, max_block=args.block) / GB
    t0 = time.perf_counter()
    weights = LazyDeviceWeights(cfg, args.seed, dev, routing=args.routing)
    wbytes = weights.nbytes()
    split_bytes = sum(nb for n, nb in wbytes.items() if _HEAD_SPLIT.search(n))
    placement = _placement(cfg, weights, budget_gb)
    host_bw = host_read_bandwidth(dev) if placement.n_cold else None
    cpu_bw = cpu_read_bandwidth() if placement.n_cold and args.cold_path != "gpu" else None
    cpu_share = args.cpu_share
    if cpu_share is None and args.cold_path == "hybrid" and placement.n_cold:  # the bandwidths just measured
        cpu_share = hybrid_cpu_share(dev, cpu_bw, host_bw)
    dec = FastDecoder(cfg, weights, max_seqs=max(batches), max_ctx=max_ctx, device=dev, consume=True,
                      placement=placement if budget_gb is not None else None, max_block=args.block,
                      moe_mode=args.moe_mode, cold_path=args.cold_path, cpu_share=cpu_share,
                      pdl=_AUTO_ON_OFF[args.pdl],
                      overlap=False if args.no_overlap else None,
                      rank=rank.rank if rank is not None else 0, world_size=W, ep_combine=args.ep_combine,
                      shared_w2=None if args.shared_w2 == "auto" else args.shared_w2, router=args.router,
                      shared_after_router=_AUTO_ON_OFF[args.shared_after_router],
                      attn_split=_AUTO_ON_OFF[args.attn_split], vocab_split=_AUTO_ON_OFF[args.vocab_split])
    del weights
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    fill_state(dec, args.context)
    bw = stream_read_bandwidth(dev)
    # the cold bytes' path: the GPU's host reads, the CPU's, or both at once (ideal split)
    cold_bw = {"gpu": host_bw, "cpu": cpu_bw, "hybrid": (host_bw or 0) + (cpu_bw or 0)}[args.cold_path]
    return BenchSetup(cfg, dec, batches, W, wbytes, split_bytes, placement, host_bw, cpu_bw, cpu_share, gen_s, bw,
                      cold_bw, peer, budget_gb, free_at_start)


def measure(run: BenchSetup, runner, args: argparse.Namespace, count_reads: bool = True) -> list[dict]:
    """Each batch's step times through `runner` (graph replays), with its bytes and roofline, and
    (count_reads, one GPU) the routed experts its rows read (`routed_reads`)."""
    results = []
    W, dec = run.world_size, run.dec
    for B in run.batches:
        if dec.sidecar is not None:
            dec.sidecar.reset_counters()
        ms = time_graph(runner, B, args.context, args.iters, block=args.block)
        dec.check_waits()  # a step whose device-side wait gave up (the CPU's experts, u) is no measurement
        p50 = pct(ms, 50)
        nb = step_bytes(run.cfg, run.wbytes, B, args.context, run.placement)
        if W > 1:  # per GPU: its share of the routed experts (uniformly spread expectation)
            nb["routed_experts"] /= W
            if dec.split_peer is not None:  # and of the head-split attention weights
                nb["dense"] -= run.split_bytes * (W - 1) / W
            if dec.vocab_peer is not None:  # and of the lm head
                nb["head"] /= W
            nb["total"] = nb["dense"] + nb["routed_experts"] + nb["head"] + nb["state"]
        roof_ms = _roofline_ms(run, nb)
        # what the CPU sidecar did in these steps (recipe B / hybrid): its own time, not the GPU's wait
        sidecar = dec.sidecar.report() if dec.sidecar is not None else None
        # the experts these rows read (eager steps after the replays; one GPU: an eager step of a
        # rank would have to run on every rank)
        reads = routed_reads(dec, run.placement, B, args.context, args.block) if count_reads and W == 1 else None
        if reads is not None:
            mean = tuple(statistics.fmean(reads[k]) for k in ("hot_per_step", "cold_per_step"))
            reads["roofline_ms"] = _roofline_ms(run, step_bytes(run.cfg, run.wbytes, B, args.context, reads=mean))
        results.append({
            "batch": B, "ms_p50": p50, "ms_p90": pct(ms, 90), "ms_p99": pct(ms, 99),
            "tokens_per_s": B / p50 * 1e3, "bytes": nb, "roofline_ms": roof_ms,
            "pct_of_roofline": 100 * roof_ms / p50,
            "achieved_GBps": (nb["total"] + nb["host_experts"]) / (p50 / 1e3) / 1e9,
            "sidecar_cpu": sidecar,
            "reads": reads,
        })
    return results


def _roofline_ms(run: BenchSetup, nb: dict[str, float]) -> float:
    """HBM bytes / HBM bandwidth + host bytes / the cold path's bandwidth, ms."""
    return (nb["total"] / (run.bw * 1e9) + (nb["host_experts"] / (run.cold_bw * 1e9) if run.cold_bw else 0.0)) * 1e3


def run_bench(args: argparse.Namespace, rank=None) -> dict:
    """The benchmark on one GPU, or (rank: a runtime.distributed.Rank) as one rank of an
    expert-parallel run: the rank holds 1/W of the routed experts, every step all-reduces the
    pair outputs (NCCL, inside the graphs), and bytes and roofline are per GPU."""
    run = setup(args, rank)
    cfg, dec, W, batches, placement = run.cfg, run.dec, run.world_size, run.batches, run.placement
    runner = run.runner(args)
    results = measure(run, runner, args)
    out = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dec.device),
        "torch": torch.__version__, "preset": args.preset, "layers": cfg.num_hidden_layers, "gpus": W,
        "context": args.context, "block": args.block, "cold_path": args.cold_path, "cpu_share": run.cpu_share,
        "cpu_read_GBps": run.cpu_bw,
        "sidecar": (None if dec.sidecar is None else "zero_copy" if dec.sidecar.zero_copy
                    else "poll" if dec.sidecar.poll else "host_fn"),
        "moe_mode": dec.moe_mode or "default", "pdl": args.pdl, "overlap": dec.side_stream is not None,
        "shared_w2": args.shared_w2, "shared_after_router": args.shared_after_router,
        "router": args.router or "auto",
        "ep_combine": None if W == 1 else "p2p" if dec.peer is not None else "allreduce",
        "attn_split": dec.split_peer is not None, "vocab_split": dec.vocab_peer is not None,
        "stream_read_GBps": run.bw, "host_read_GBps": run.host_bw, "weights_generated_s": run.gen_s,
        "routing": args.routing, "placement": {"hbm_budget_GB": run.budget_gb, "auto": args.hbm_budget == AUTO,
                                               "hbm_bytes": placement.hbm_bytes, "profile": placement.profile_kind,
                                               "n_hot": placement.n_hot, "n_cold": placement.n_cold,
                                               "cold_slot_fraction": placement.cold_fraction},
        "state_pool_bytes": dec.pools.bytes(), "results": results, "peer": run.peer,
    }
    out["device_memory"] = device_memory(dec.device, run.free_at_start)
    if args.timeline:
        from megastep.runtime.trace import timeline_summary

        out["timeline"] = {}
        for B in batches:
            acts = timeline_graph(runner, B, args.context, args.block)
            out["timeline"][B] = {"summary": timeline_summary(acts), "activities": acts}
    if args.trace:
        traces = {}
        for B in batches:
            by_stage, by_layer, wall = trace_step(dec, B, args.context, block=args.block)
            traces[B] = {"by_stage_us": by_stage, "by_layer_us": {str(k): v for k, v in by_layer.items()},
                         "eager_wall_ms": wall, "kernels": trace_kernels(dec, B, args.context, args.block)}
        out["trace"] = traces
    return out


def device_memory(dev: torch.device, free_at_start: int) -> dict[str, float]:
    """GB of the device's memory: its total, free before the weights were built and now, and the
    peaks of torch's allocator (allocated, and reserved: what it held from the device) over the run.
    How close a budget came to the card (`--hbm-budget auto`'s margin is set from these)."""
    free, total = torch.cuda.mem_get_info(dev)
    return {"total_GB": total / 1e9, "free_at_start_GB": free_at_start / 1e9, "free_GB": free / 1e9,
            "peak_allocated_GB": torch.cuda.max_memory_allocated(dev) / 1e9,
            "peak_reserved_GB": torch.cuda.max_memory_reserved(dev) / 1e9}


def _placement(cfg: ModelConfig, weights, hbm_budget_gb: float | None):
    """Expert placement for the run, from the routing of the synthetic gates themselves (random
    unit-RMS activations through each gate): every expert in HBM without a budget."""
    from megastep.routing import profile_from_random_activations
    from megastep.runtime.experts import plan_placement

    profile = profile_from_random_activations(cfg, weights)
    budget = float("inf") if hbm_budget_gb is None else hbm_budget_gb * GB
    return plan_placement(cfg, profile, int(min(budget, 2**62)))


def print_report(out: dict) -> None:
    L = out["layers"]
    ep = f" (experts split, {out['ep_combine']} combine)" if out.get("ep_combine") else ""
    for key, what in (("attn_split", "attention heads"), ("vocab_split", "vocabulary")):
        if out.get(key):
            ep = ep[:-1] + f", {what} split)"
    print(f"\n{out['device']} x{out.get('gpus', 1)}{ep}  preset {out['preset']}  layers {L}  context {out['context']}  "
          f"stream read {out['stream_read_GBps']:.0f} GB/s  routing {out['routing']}")
    pl = out["placement"]
    if pl["n_cold"]:
        auto = " (auto)" if pl.get("auto") else ""
        print(f"HBM budget {pl['hbm_budget_GB']:.2f} GB{auto}: {pl['n_hot']} experts in HBM, {pl['n_cold']} in host "
              f"memory (cold share of routing slots {100 * pl['cold_slot_fraction']:.1f}%), host read "
              f"{out['host_read_GBps']:.1f} GB/s; roofline = HBM bytes / HBM bw + host bytes / host bw")
        if out["cpu_read_GBps"]:
            share = f" (CPU share {out['cpu_share']:.2f})" if out["cold_path"] == "hybrid" else ""
            sidecar = f", sidecar {out['sidecar']}" if out.get("sidecar") else ""  # (older results lack it)
            print(f"cold experts: {out['cold_path']}{share}{sidecar}, CPU read {out['cpu_read_GBps']:.1f} "
                  "GB/s; host bw of the roofline: " + {"cpu": "the CPU's", "hybrid": "GPU + CPU"}[out["cold_path"]])
    mem = out.get("device_memory")  # (older results lack it)
    if mem:
        weights = f", weights in HBM {pl['hbm_bytes'] / 1e9:.1f}" if "hbm_bytes" in pl else ""
        print(f"device memory (GB): {mem['total_GB']:.1f}, free at start {mem['free_at_start_GB']:.1f}{weights}; "
              f"peak allocated {mem['peak_allocated_GB']:.1f}, peak reserved {mem['peak_reserved_GB']:.1f}; "
              f"free at the end {mem['free_GB']:.1f}")
    print(f"{'batch':>5} {'p50 ms':>8} {'p90':>8} {'p99':>8} {'tok/s':>9} {'GB/step':>8} {'roof ms':>8} {'%roof':>6} "
          f"{'ms/layer':>8} {'x43 ms':>8}")
    for r in out["results"]:
        per_layer = r["ms_p50"] / L
        print(f"{r['batch']:>5} {r['ms_p50']:>8.3f} {r['ms_p90']:>8.3f} {r['ms_p99']:>8.3f} {r['tokens_per_s']:>9.1f} "
              f"{r['bytes']['total'] / 1e9:>8.3f} {r['roofline_ms']:>8.3f} {r['pct_of_roofline']:>6.1f} "
              f"{per_layer:>8.3f} {per_layer * 43:>8.2f}")
    for r in out["results"]:
        c = r.get("sidecar_cpu")  # (older results lack it)
        if c:
            busy = (f"a busy job {c['busy_job_us_mean']:.0f} us mean, {c['busy_job_us_max']:.0f} max, "
                    f"{c['cpu_GBps']:.1f} GB/s of expert bytes" if c["busy_jobs_per_step"] else "no job read an expert")
            idle = f"; the other jobs {c['idle_job_us_mean']:.1f} us each" if c["idle_job_us_mean"] is not None else ""
            print(f"CPU sidecar, batch {r['batch']}: {c['busy_jobs_per_step']:.2f} of {c['jobs_per_step']} jobs a step "
                  f"read {c['experts_per_step']:.2f} experts in {c['busy_ms_per_step']:.3f} ms of CPU time ({busy}){idle}; "
                  f"{c['steps']} steps")
    for r in out["results"]:
        rd = r.get("reads")  # (older results lack it)
        if rd:
            b = r["bytes"]
            print(f"batch {r['batch']}: routed experts the rows read in {rd['steps']} eager steps: "
                  f"{'/'.join(map(str, rd['hot_per_step']))} in HBM, {'/'.join(map(str, rd['cold_per_step']))} in "
                  f"host memory (expected {b['hot_experts_per_step']:.1f} / {b['cold_experts_per_step']:.2f}); "
                  f"roofline with these reads {rd['roofline_ms']:.3f} ms ({100 * rd['roofline_ms'] / r['ms_p50']:.1f}%)")
            if rd.get("passes_per_step"):  # (older results lack it)
                read = sum(rd["hot_per_step"]) + sum(rd["cold_per_step"])
                down = ""
                if rd.get("down_passes_per_step"):  # (older results lack it)
                    down = (f"; down's ({rd['down_pairs_per_pass']} pairs a pass): "
                            f"{'/'.join(map(str, rd['down_passes_per_step']))}, "
                            f"{sum(rd['down_passes_per_step']) / max(read, 1):.3f} per expert read")
                width = rd.get("pairs_per_pass", moe_lut.PAIRS_PER_PASS)  # (older results lack it)
                print(f"  the experts kernels' passes over those experts' weights ({width} pairs a "
                      f"pass): {'/'.join(map(str, rd['passes_per_step']))}, "
                      f"{sum(rd['passes_per_step']) / max(read, 1):.3f} per expert read{down}; the most pairs on one "
                      f"expert {'/'.join(map(str, rd['most_pairs']))}")
    if out.get("peer"):
        p = out["peer"]
        print(f"peer transformers ({p['best_impl']}, {p['layers']} layers, batch 1): {p['ms_per_step']}  "
              f"-> {p['ms_per_layer']} ms/layer")
    for B, tl in (out.get("timeline") or {}).items():
        print_timeline(f"timeline of one graph replay, batch {B}", tl)
    for B, tr in (out.get("trace") or {}).items():
        tot = sum(tr["by_stage_us"].values())
        print(f"\ntrace batch {B}: eager wall {tr['eager_wall_ms']:.2f} ms, sum of stages {tot / 1e3:.2f} ms")
        for name, us in sorted(tr["by_stage_us"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:<16} {us / 1e3:8.3f} ms  {100 * us / tot:5.1f}%  ({us / L:7.1f} us/layer)")
        ks = tr.get("kernels") or {}
        if ks:
            dev_ms = sum(v["device_us"] for v in ks.values()) / 1e3
            p50 = next(r["ms_p50"] for r in out["results"] if str(r["batch"]) == str(B))
            print(f"kernels of the same step (device time, launches): {dev_ms:.2f} ms in "
                  f"{sum(v['kernels'] for v in ks.values())} launches; graph replay {p50:.2f} ms "
                  f"-> {p50 - dev_ms:.2f} ms between kernels")
            for name, v in sorted(ks.items(), key=lambda kv: -kv[1]["device_us"]):
                top = sorted(v.get("names", {}).items(), key=lambda kv: -kv[1][0])[:3]
                print(f"  {name:<16} {v['device_us'] / L:7.1f} us/layer  {v['kernels'] / L:5.1f} launches/layer  "
                      + ", ".join(f"{n[:40]} {us / L:.1f}" for n, (us, _) in top))


def print_timeline(title: str, tl: dict) -> None:
    """A timeline's lines of the report (tl: {"summary": timeline_summary, "activities": ...})."""
    from megastep.runtime.trace import timeline_phases

    sm = tl["summary"]
    print(f"\n{title}: {sm['activities']} kernels over {sm['span_us'] / 1e3:.3f} ms, "
          f"{sm['sum_us'] / 1e3:.3f} ms of kernel time, covered {sm['busy_us'] / 1e3:.3f} ms, idle "
          f"{sm['idle_us'] / 1e3:.3f} ms; largest idle stretches (us, after): "
          + ", ".join(f"{g['us']:.1f} {g['after'][:30]}" for g in sm["largest_gaps"][:4]))
    ph = timeline_phases(tl["activities"])
    if ph["moe_phase_median_us"] is not None:
        print(f"  MoE sublayer (routing's end to the experts' end) median {ph['moe_phase_median_us']:.1f} us, "
              f"layer period median {ph['layer_period_median_us'] or 0:.1f} us")
    print("  the span by the kernel that ends each stretch, us: "
          + ", ".join(f"{name[:28]} {us:.0f}" for name, us in list(ph["span_by_kernel_us"].items())[:6]))
    an = ph["anatomy"]
    for k in an["kinds"]:  # a layer's path: what each part of its period closes
        period = sum(p["charge_us"] for p in k["parts"])
        print(f"  {k['periods']} of {an['periods']} layer periods alike ({period:.1f} us), the stretch each part "
              "closes, us: " + ", ".join(f"{p['name'].strip('_').replace('_kernel', '')[:26]} {p['charge_us']:.1f}"
                                        for p in k["parts"]))


def _bench_rank(rank, args: argparse.Namespace) -> dict | None:
    out = run_bench(args, rank)
    return out if rank.rank == 0 else None


def bench_main(args: argparse.Namespace) -> int:
    if args.gpus:
        gpus = D.parse_gpus(args.gpus)
        D.check_world_size(preset(args.preset, layers=args.layers).n_routed_experts, len(gpus))
        _check_args(args, _batches(args.batch))
        out = D.launch(_bench_rank, len(gpus), (args,), backend="nccl", gpus=gpus, timeout_s=3600)[0]
    else:
        out = run_bench(args)
    print_report(out)  # (first: a --json that cannot be written after all loses none of it)
    if args.json:
        with writing(f"--json {args.json}"), open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", default="1,4,16,64")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="also print the eager per-stage trace")
    p.add_argument("--shared-w2", default="auto", choices=["auto", "residual", "combine", "mhc"],
                   help="where the shared expert's w2 runs: after the routed experts with their sum as its residual, "
                        "or beside them, added by their combine or by the next mHC launch (FastDecoder.shared_w2; "
                        "the same bits); auto: by the step's rows (FastDecoder's MOE_PLAN)")
    p.add_argument("--shared-after-router", default="auto", choices=["auto", "on", "off"],
                   help="fork the shared expert's side stream after the router (on) or before it (off); auto: by "
                        "the step's rows (FastDecoder's MOE_PLAN; the same bits)")
    p.add_argument("--timeline", action="store_true",
                   help="also profile one graph replay per batch: each kernel's start and end in the --json file, "
                        "idle time and the largest idle stretches printed")
    p.add_argument("--peer-layers", type=int, default=0, help="layers for the transformers peer line (0: skip)")
    p.add_argument("--json", help="write the full results here")
    p.add_argument("--block", type=int, default=1,
                   help="rows per sequence: each step advances batch/block sequences by a causal block of this many tokens")
    p.add_argument("--moe-mode", default=None, choices=["fma", "dot", "dot_asm", "dot_scaled", "lut"],
                   help="routed-experts kernel mode (default: the CUDA 'lut' kernels where they run, else the "
                        "Triton kernels' own pick)")
    p.add_argument("--router", default=None, choices=["cuda", "triton"],
                   help="the routing after the gate GEMV: one CUDA C++ launch or router.py's Triton launches (the "
                        "same bits); default: by the step's rows (FastDecoder's MOE_PLAN)")
    p.add_argument("--pdl", default="auto", choices=["auto", "on", "off"],
                   help="programmatic dependent launch of the step's kernels: on, off, or auto (on for steps of "
                        "at most FastDecoder's PDL_MAX_ROWS rows on one GPU, PDL_MAX_ROWS_EP on several, where it "
                        "was measured faster)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run every kernel of a layer on one stream (default: the independent parts on a second one)")
    p.add_argument("--cold-path", default="gpu", choices=["gpu", "cpu", "hybrid"],
                   help="with --hbm-budget: cold experts read by the GPU from host memory (recipe A), computed by "
                        "the CPU (B), or split between the two (hybrid)")
    p.add_argument("--cpu-share", type=float, default=None,
                   help="hybrid: the CPU's share of the cold bytes (default: its share of the two paths' "
                        "bandwidths, measured in the run)")
    p.add_argument("--routing", default="default", choices=["default", "uniform", "skewed"],
                   help="routing model of the synthetic gates (megastep.routing)")
    p.add_argument("--gpus", default=None,
                   help="e.g. 0,1,2,3: one process per GPU, routed experts sharded across them (NCCL)")
    p.add_argument("--ep-combine", default=None, choices=["p2p", "allreduce"],
                   help="with --gpus: the experts' outputs read from their GPU over NVLink by one kernel (p2p, "
                        "the default where it runs) or an integer all-reduce through NCCL")
    p.add_argument("--attn-split", default="auto", choices=["auto", "on", "off"],
                   help="with --gpus: split the attention's heads over the GPUs (tensor parallelism, the same bits; "
                        "auto: model/fast.py's ATTN_SPLIT)")
    p.add_argument("--vocab-split", default="auto", choices=["auto", "on", "off"],
                   help="with --gpus: split the lm head's vocabulary over the GPUs (the same bits; auto: "
                        "model/fast.py's VOCAB_SPLIT)")
    p.add_argument("--hbm-budget", type=budget_arg, default=None, metavar="GB|auto",
                   help="GB of HBM for weights: the coldest routed experts go to page-locked host memory; auto: "
                        "what the device has free, less the state, a layer's build and a margin (runtime/experts.py)")
