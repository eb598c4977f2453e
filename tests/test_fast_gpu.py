"""The fast path on a CUDA device (skipped without one): determinism, eager vs CUDA-graph identity,
the same bits after a relaunch, and batch invariance (a row's bits do not depend on the other rows
of its step). See docs/NUMERICS.md for why greedy
agreement with the reference over long runs is measured (benchmarks/gpu_check.py), not asserted."""

import hashlib
import subprocess
import sys

import pytest
import torch

from megastep.kernels import common as _common

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from test_fast_gpu import greedy_logits
print("HASH", hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in greedy_logits()[1])).hexdigest())
"""


def build(layers=2, max_seqs=16, experts="triton", router=None, overlap=None):
    """experts: "triton" (the small preset: its I = 256 keeps the CUDA "lut" kernels out) or "lut"
    (I = 512, so the decoder picks the CUDA experts kernels, as it does at V4-Flash shapes).
    router: FastDecoder's (None: by the step's rows, its MOE_PLAN)."""
    import dataclasses

    from megastep.checkpoint.synthetic import preset, synthesize_weights
    from megastep.model.fast import FastDecoder
    from megastep.runtime.step import StepRunner

    cfg = preset("small", layers=layers)
    if experts == "lut":
        cfg = dataclasses.replace(cfg, moe_intermediate_size=512)
    dec = FastDecoder(cfg, synthesize_weights(cfg, seed=0, device="cuda", include_mtp=False),
                      max_seqs=max_seqs, max_ctx=512, device="cuda", router=router, overlap=overlap)
    assert dec.moe_mode == ("lut" if experts == "lut" else None), dec.moe_mode
    assert dec.router == router and dec.route_cuda_ok, (dec.router, dec.route_cuda_ok)
    return cfg, dec, StepRunner(dec.step, dec.device, dec.pools.dummy_slot, buckets=(1, 16))


def greedy_logits(steps=24, built=None):
    cfg, dec, runner = built or build()
    dec.pools.reset(0)
    prompt = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    toks, logits = [], []
    for t in range(len(prompt) + steps):
        tok = prompt[t] if t < len(prompt) else toks[-1]
        lg, nt = runner.run(*(torch.tensor([v], device="cuda") for v in (tok, t, 0)))
        if t >= len(prompt) - 1:
            toks.append(int(nt[0]))
            logits.append(lg[0].clone())
    return toks, logits


def alone_then_batched(built) -> list[torch.Tensor]:
    """The logits of greedy_logits(steps=6) (one sequence, 1-row graphs), then of three steps of a
    batch of 16 fresh rows (the 16-row bucket)."""
    cfg, dec, runner = built
    out = greedy_logits(steps=6, built=built)[1]
    for s in range(16):
        dec.pools.reset(s)
    toks = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(5)).cuda()
    for t in range(3):
        out.append(runner.run(toks, torch.full((16,), t, device="cuda"), torch.arange(16, device="cuda"))[0])
    return out


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_same_input_same_bits(experts):
    built = build(experts=experts)
    a, b = greedy_logits(built=built), greedy_logits(built=built)
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("experts,sinkhorn", [("triton", "side"), ("lut", "side"), ("lut", None), ("lut", "own")])
def test_side_stream_changes_no_bits(experts, sinkhorn, monkeypatch):
    """The second stream (the compressors and the kv store beside the q path, the shared expert
    beside the routed experts; sinkhorn: every mHC finish's Sinkhorn beside the sublayer, as
    fast.MHC_SINKHORN_BESIDE_ROWS has it at 1 row, on the side stream or on a stream of its own,
    MHC_SINKHORN_OWN_STREAM_ROWS) against one stream: the same tokens and logits. The small preset's
    layer 1 is a CSA layer (compressors and the indexer)."""
    from megastep.checkpoint.synthetic import preset
    from megastep.model import fast

    monkeypatch.setattr(fast, "MHC_SINKHORN_BESIDE_ROWS", 16 if sinkhorn else 0)
    monkeypatch.setattr(fast, "MHC_SINKHORN_OWN_STREAM_ROWS", (1, 16) if sinkhorn == "own" else (0, 0))
    assert preset("small", layers=2).ratio(1) == 4
    one = greedy_logits(built=build(experts=experts, overlap=False))
    two = greedy_logits(built=build(experts=experts, overlap=True))
    assert one[0] == two[0]
    assert all(torch.equal(x, y) for x, y in zip(one[1], two[1]))


def test_same_bits_after_relaunch():
    here = hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in greedy_logits()[1])).hexdigest()
    import os

    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=os.path.dirname(__file__))],
                         capture_output=True, text=True, timeout=600)
    assert f"HASH {here}" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_graph_replay_equals_eager_step(experts):
    cfg, dec, runner = build(experts=experts)
    for slot in (0, 1):
        dec.pools.reset(slot)
    t = torch.tensor([5], device="cuda")
    p = torch.tensor([0], device="cuda")
    g, _ = runner.run(t, p, torch.tensor([0], device="cuda"))
    e = dec.step(t, p, torch.tensor([1], device="cuda"))
    assert torch.equal(g, e)


@pytest.mark.parametrize("sms,experts,plain", [(None, "triton", None), (4, "triton", None), (None, "lut", None),
                                               (4, "lut", 0)])
def test_pdl_changes_no_bits(sms, experts, plain, monkeypatch):
    """Programmatic dependent launch only moves when kernels start: 16 rows, then 1, through
    graphs captured with PDL give the bits of the graphs without it, step after step. sms=4: the
    launches believe the GPU has 4 SMs, so nearly every grid takes the late release (PDL_LATE)
    and the weight prefetch, as the full-size model's linears do. "lut": the CUDA experts kernels
    launched with PDL too (down requests its first weights before it waits). plain=0: every FP8
    linear placed plainly and releasing its dependents (PDL_PLAIN) between kernels placed early."""
    if sms is not None:
        monkeypatch.setitem(_common._SMS, torch.cuda.current_device(), sms)
    monkeypatch.setattr(_common, "PLAIN_PLACEMENT_BYTES", plain)
    cfg, dec, runner = build(experts=experts)
    _, dec2, runner2 = build(experts=experts)
    dec.pdl, dec2.pdl = False, True
    g = torch.Generator().manual_seed(4)
    for d in (dec, dec2):
        for s in range(16):
            d.pools.reset(s)
    for rows in (16, 1):
        for t in range(6):
            toks = torch.randint(0, cfg.vocab_size, (rows,), generator=g).cuda()
            args = (toks, torch.full((rows,), t if rows == 16 else 6 + t, device="cuda"),
                    torch.arange(rows, device="cuda"))
            a, _ = runner.run(*args)
            b, _ = runner2.run(*args)
            assert torch.equal(a, b)


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_alone_equals_row_of_batch_of_16(experts):
    cfg, dec, runner = build(experts=experts)
    toks, alone = greedy_logits(steps=4, built=(cfg, dec, runner))
    for s in range(16):
        dec.pools.reset(s)
    prompt = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = prompt + toks[:4]
    others = torch.randint(0, cfg.vocab_size, (15, len(seq)), generator=torch.Generator().manual_seed(2))
    for t in range(len(seq)):
        lg, _ = runner.run(torch.tensor([seq[t]] + others[:, t].tolist(), device="cuda"),
                           torch.full((16,), t, device="cuda"), torch.arange(16, device="cuda"))
        if t >= len(prompt) - 1:
            assert torch.equal(lg[0], alone[t - len(prompt) + 1])


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_cuda_routing_gives_the_triton_routers_bits(experts, monkeypatch):
    """The step with the one-launch CUDA routing against router.py's launches, and with the CUDA
    launch leaving the grouping to the experts' own routing launch: the same greedy logits bit for
    bit, at 1 row (graphs with PDL) and in a batch of 16."""
    from megastep.kernels import route_cuda

    want = alone_then_batched(build(experts=experts, router="triton"))
    got = alone_then_batched(build(experts=experts, router="cuda"))
    monkeypatch.setattr(route_cuda, "MAX_GROUPED_PAIRS", 0)
    ungrouped = alone_then_batched(build(experts=experts, router="cuda"))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(want, got, ungrouped))


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_indexer_beside_changes_no_bits(experts, monkeypatch):
    """fast.INDEXER_BESIDE_ROWS: a CSA layer's indexer on a stream of its own beside the attention's
    wq_b (the qr group in two launches, each with the group launch's configuration) against the qr
    group in one launch and the indexer after it: the same logits at 1 row and in a batch of 16,
    past position 4 * 64 where the small preset's CSA layer (layer 1) selects 64 of its visible
    compressed entries."""
    from megastep.model import fast

    arms = []
    for rows in (0, 16):
        monkeypatch.setattr(fast, "INDEXER_BESIDE_ROWS", rows)
        cfg, dec, runner = built = build(experts=experts)
        assert cfg.ratio(1) == 4 and cfg.index_topk == 64
        out = greedy_logits(steps=300, built=built)[1][-40:]
        for s in range(16):
            dec.pools.reset(s)
        toks = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(5)).cuda()
        for t in range(280):
            lg, nt = runner.run(toks, torch.full((16,), t, device="cuda"), torch.arange(16, device="cuda"))
            toks = nt.clone()
        arms.append(out + [lg.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*arms))


def test_block_step_in_a_graph_matches_eager_and_single_rows():
    """Multi-token blocks through a CUDA graph: a 4-token block equals the eager block step bit for
    bit, and each row agrees to rounding with decoding the tokens one by one."""
    import functools

    from megastep.checkpoint.synthetic import preset, synthesize_weights
    from megastep.model.fast import FastDecoder
    from megastep.runtime.step import StepRunner

    cfg = preset("small", layers=2)
    w = synthesize_weights(cfg, seed=0, device="cuda", include_mtp=False)
    dec = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device="cuda", max_block=4)
    one = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device="cuda")
    runner = StepRunner(functools.partial(dec.step, block=4), dec.device, dec.pools.dummy_slot, buckets=(4,))
    for d in (dec, one):
        d.pools.reset(0), d.pools.reset(1)
    toks = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    for b0 in range(0, 12, 4):
        rows = torch.tensor(toks[b0:b0 + 4], device="cuda")
        pos = torch.arange(b0, b0 + 4, device="cuda")
        g, _ = runner.run(rows, pos, torch.zeros(4, dtype=torch.long, device="cuda"))
        e = dec.step(rows, pos, torch.ones(4, dtype=torch.long, device="cuda"), block=4)  # slot 1: its twin
        assert torch.equal(g, e)
        for i in range(4):
            s = one.step(rows[i:i + 1], pos[i:i + 1], torch.zeros(1, dtype=torch.long, device="cuda"))
            assert torch.corrcoef(torch.stack([g[i], s[0]]))[0, 1] > 0.99  # rounding apart (docs/NUMERICS.md)


def _half_cold():
    """The small preset (2 layers, synthetic weights on the GPU) and a placement that keeps half of
    its routed experts cold (host memory): (cfg, weights, plan)."""
    from megastep.checkpoint.synthetic import preset, synthesize_weights
    from megastep.runtime.experts import plan_placement, resident_bytes, routed_expert_bytes

    cfg = preset("small", layers=2)
    w = synthesize_weights(cfg, seed=0, device="cuda", include_mtp=False)
    half = cfg.num_hidden_layers * cfg.n_routed_experts // 2
    return cfg, w, plan_placement(cfg, None, resident_bytes(cfg) + half * routed_expert_bytes(cfg))


@pytest.mark.parametrize("cold_path", ["gpu", "cpu", "hybrid"])
def test_cold_expert_recipes_in_a_graph(cold_path):
    """Cold experts in page-locked host memory, read by the GPU (A), computed by the CPU sidecar (B;
    polled by default, sidecar.POLL) or split (hybrid): graph replay equals the eager step bit for bit; A
    equals every expert in HBM bit for bit, B and hybrid to rounding."""
    from megastep.model.fast import FastDecoder
    from megastep.runtime.step import StepRunner

    cfg, w, plan = _half_cold()
    dec = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device="cuda", placement=plan, cold_path=cold_path)
    hot = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device="cuda")
    runner = StepRunner(dec.step, dec.device, dec.pools.dummy_slot, buckets=(2,))
    for d in (dec, hot):
        d.pools.reset(0), d.pools.reset(1)
    for t in range(4):  # one sequence twice: slot 0 through the graph, slot 1 eagerly
        tok = torch.randint(0, cfg.vocab_size, (1,), generator=torch.Generator().manual_seed(t)).cuda()
        pos = torch.full((1,), t, device="cuda")
        want = hot.step(tok, pos, torch.zeros(1, dtype=torch.long, device="cuda"))
        g, _ = runner.run(tok, pos, torch.zeros(1, dtype=torch.long, device="cuda"))
        e = dec.step(tok, pos, torch.ones(1, dtype=torch.long, device="cuda"))
        assert torch.equal(g[0], e[0])
        if cold_path == "gpu":  # the same kernel on the same bytes, wherever they live
            assert torch.equal(e[0], want[0])
        else:  # the CPU kernel sums in another order: rounding apart
            assert torch.corrcoef(torch.stack([e[0], want[0]]))[0, 1] > 0.99


@pytest.mark.parametrize("cold_path", ["cpu", "hybrid"])
def test_polling_sidecar_gives_the_host_functions_bits(cold_path, monkeypatch):
    """sidecar.POLL (a flag word per job in page-locked memory, written and awaited by the side
    stream, and a CPU thread that scans them, instead of a host node per layer) and sidecar.ZERO_COPY
    (the job posted and collected by two kernels on the step's stream, through page-locked memory in
    place) give the host-function sidecar's logits bit for bit, replayed from a CUDA graph (bucket 2:
    a padded row) and eagerly, over 6 steps of one sequence."""
    from megastep.model.fast import FastDecoder
    from megastep.runtime import sidecar
    from megastep.runtime.step import StepRunner

    cfg, w, plan = _half_cold()
    out = {}
    for poll, zero_copy in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(sidecar, "POLL", poll)
        monkeypatch.setattr(sidecar, "ZERO_COPY", zero_copy)
        dec = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device="cuda", placement=plan, cold_path=cold_path)
        assert dec.sidecar is not None and (dec.sidecar.poll, dec.sidecar.zero_copy) == (poll, zero_copy)
        runner = StepRunner(dec.step, dec.device, dec.pools.dummy_slot, buckets=(2,))
        dec.pools.reset(0), dec.pools.reset(1)
        rows = []
        for t in range(6):  # slot 0 through the graph, slot 1 eagerly
            tok = torch.randint(0, cfg.vocab_size, (1,), generator=torch.Generator().manual_seed(t)).cuda()
            pos = torch.full((1,), t, device="cuda")
            g, _ = runner.run(tok, pos, torch.zeros(1, dtype=torch.long, device="cuda"))
            rows.append((g[0].clone(), dec.step(tok, pos, torch.ones(1, dtype=torch.long, device="cuda"))[0].clone()))
        torch.cuda.synchronize()
        r = dec.sidecar.report()  # the jobs' counters, whichever way they were started
        assert r is not None and r["steps"] >= 6 and r["experts_per_step"] > 0 and r["cpu_GBps"] > 0
        dec.sidecar.check()  # no zero-copy wait gave up
        out[poll, zero_copy] = rows
        del runner, dec
    host_fn = out[False, False]
    for mode in ((True, False), (False, True)):
        for (g0, e0), (g1, e1) in zip(host_fn, out[mode]):
            assert torch.equal(g0, e0) and torch.equal(g1, e1) and torch.equal(g0, g1), mode


def test_lut_experts_agree_with_the_triton_kernels():
    """The CUDA "lut" experts and the Triton "dot_asm" ones sum in different orders: the same
    model's logits agree to rounding (docs/NUMERICS.md) for 4 rows over 4 steps."""
    from megastep.checkpoint.synthetic import synthesize_weights
    from megastep.model.fast import FastDecoder

    cfg, dec, _ = build(experts="lut")
    ref = FastDecoder(cfg, synthesize_weights(cfg, seed=0, device="cuda", include_mtp=False), max_seqs=16,
                      max_ctx=512, device="cuda", moe_mode="dot_asm")
    g = torch.Generator().manual_seed(9)
    for d in (dec, ref):
        for s in range(4):
            d.pools.reset(s)
    for t in range(4):
        args = (torch.randint(0, cfg.vocab_size, (4,), generator=g).cuda(), torch.full((4,), t, device="cuda"),
                torch.arange(4, device="cuda"))
        a, b = dec.step(*args), ref.step(*args)
        for i in range(4):
            assert torch.corrcoef(torch.stack([a[i].float(), b[i].float()]))[0, 1] > 0.9999


def test_replay_timeline_sees_the_graphs_kernels():
    """`megastep bench --timeline`'s profile of one graph replay: the graph's kernels are on the
    device timeline (CUPTI records graph-launched kernels), in start order, within the span."""
    from megastep.runtime.trace import replay_timeline, timeline_summary

    cfg, dec, runner = build()
    dec.pools.reset(0)
    b = runner.load(*(torch.tensor([v], device="cuda") for v in (5, 0, 0)))
    runner.replay(b)
    acts = replay_timeline(lambda: runner.replay(b), dec.device)
    names = {a["name"] for a in acts}
    assert len(acts) >= 5 * cfg.num_hidden_layers and any("linear_fp8" in n for n in names), sorted(names)[:20]
    assert all(a["dur_us"] >= 0 for a in acts) and acts == sorted(acts, key=lambda a: a["start_us"])
    sm = timeline_summary(acts)
    assert 0 < sm["busy_us"] <= sm["span_us"] and sm["idle_us"] >= 0


@pytest.mark.parametrize("experts", ["triton", "lut"])
@pytest.mark.parametrize("where", ["combine", "mhc", "after_router", "plan"])
def test_shared_expert_in_the_combine_gives_the_same_bits(experts, where):
    """The shared expert's w2 on the side stream with its output added by the experts' combine
    ("combine") or by the next mHC launch ("mhc"), its side stream forked after the router
    ("after_router"), or all three by MOE_PLAN ("plan": the defaults), against the order before
    them (w2 after the routed experts with their sum as its residual, the side stream forked
    before the router): the same greedy logits bit for bit, through the graphs (PDL at 1 row)."""
    built = build(experts=experts)
    if where == "after_router":
        built[1].shared_after_router = True
    elif where != "plan":
        built[1].shared_w2 = where
    assert all("shared13" in lw for lw in built[1].layers)
    a = greedy_logits(steps=8, built=built)
    before = build(experts=experts)
    before[1].shared_w2, before[1].shared_after_router = "residual", False
    b = greedy_logits(steps=8, built=before)
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_fused_gate_route_changes_no_bits(monkeypatch):
    """route_cuda.FUSED_GATE_ROWS (the MoE gate GEMV inside the routing's launch up to 8 rows): the
    step's greedy logits at 1 row (graphs with PDL) and in a batch of 16 (above it: the two launches),
    bit for bit against the gate apart, the fused launch really taken."""
    from megastep.kernels import route_cuda

    calls = []
    fused = route_cuda.gate_route_group
    monkeypatch.setattr(route_cuda, "gate_route_group", lambda *a, **k: calls.append(1) or fused(*a, **k))
    want = alone_then_batched(build(experts="lut"))
    assert not calls
    monkeypatch.setattr(route_cuda, "FUSED_GATE_ROWS", 8)
    got = alone_then_batched(build(experts="lut"))
    assert calls
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def spy_group_parts(monkeypatch) -> list[tuple[int, int]]:
    """A list that each LinearGroup.part call appends (part index, the current stream's handle) to."""
    from megastep.model.linears import LinearGroup

    on_streams = []
    part = LinearGroup.part

    def spy(self, i, *a, **k):
        on_streams.append((i, torch.cuda.current_stream().cuda_stream))
        return part(self, i, *a, **k)

    monkeypatch.setattr(LinearGroup, "part", spy)
    return on_streams


def test_indexer_first_changes_no_bits(monkeypatch):
    """INDEXER_FIRST (a CSA layer's indexer rows of the bf16 projection in a launch of their own before
    the compressor's, and its q rows on the indexer's stream beside wq_b): the step's greedy logits at
    1 row (graphs with PDL) and in a batch of 16, bit for bit against the order without it, the
    indexer's q rows really launched on its stream."""
    from megastep.model import fast

    on_streams = spy_group_parts(monkeypatch)
    monkeypatch.setattr(fast, "INDEXER_FIRST", False)
    want = alone_then_batched(build(experts="lut"))
    monkeypatch.setattr(fast, "INDEXER_FIRST", True)
    built = build(experts="lut")
    assert built[0].ratio(1) == 4  # layer 1: CSA
    on_streams.clear()
    got = alone_then_batched(built)
    idx_stream = built[1].idx_stream.cuda_stream
    assert (1, idx_stream) in on_streams and all(s != idx_stream for i, s in on_streams if i == 0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_q_norm_in_the_x_launch_changes_no_bits(monkeypatch):
    """fast.QNORM_TAIL_ROWS = 16: the q norm made by the x group's launch instead of rms_norm's launch
    after it: the greedy logits at 1 row (graphs with PDL) and in a batch of 16, bit for bit against
    QNORM_TAIL_ROWS = 0; the steps really asked the linear for it."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.model import fast

    monkeypatch.setattr(fast, "QNORM_TAIL_ROWS", 0)
    want = alone_then_batched(build(experts="lut"))
    tails = []
    real = lin.linear_fp8

    def spy(*a, **k):
        tails.append(k.get("norm_tail") is not None)
        return real(*a, **k)

    monkeypatch.setattr(lin, "linear_fp8", spy)
    monkeypatch.setattr(fast, "QNORM_TAIL_ROWS", 16)
    got = alone_then_batched(build(experts="lut"))
    assert any(tails)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_wo_b_partials_summed_by_the_mixes_change_no_bits(monkeypatch):
    """fast.WO_B_PARTS_ROWS = 16: wo_b's split-K partials left unsummed and summed in split order by the
    next mixes launch: the greedy logits at 1 row (graphs with PDL) and in a batch of 16, bit for bit
    against wo_b's own combine (WO_B_PARTS_ROWS = 0); the steps really took the partials, in more than
    one split."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.model import fast

    monkeypatch.setattr(fast, "WO_B_PARTS_ROWS", 0)
    want = alone_then_batched(build(experts="lut"))
    splits = []
    real = lin.linear_fp8_splits

    def spy(*a, **k):
        out = real(*a, **k)
        splits.append(out.shape[0])
        return out

    monkeypatch.setattr(lin, "linear_fp8_splits", spy)
    monkeypatch.setattr(fast, "WO_B_PARTS_ROWS", 16)
    got = alone_then_batched(build(experts="lut"))
    assert splits and min(splits) > 1, splits
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("experts", ["triton", "lut"])
def test_expert_pairs_summed_by_the_mixes_change_no_bits(experts, monkeypatch):
    """fast.MOE_PAIRS_ROWS = 16: the routed experts' per-slot outputs left unsummed and summed in slot
    order by the next mixes launch with the shared expert's output: the greedy logits at 1 row (graphs
    with PDL) and in a batch of 16, bit for bit against the experts' own combine; the pairs really asked."""
    from megastep.kernels import moe
    from megastep.model import fast

    monkeypatch.setattr(fast, "MOE_PAIRS_ROWS", 0)
    want = alone_then_batched(build(experts=experts))
    asked = []
    real = moe.moe_experts_table

    def spy(*a, **k):
        asked.append(bool(k.get("return_pairs")))
        return real(*a, **k)

    monkeypatch.setattr(moe, "moe_experts_table", spy)
    monkeypatch.setattr(fast, "MOE_PAIRS_ROWS", 16)
    got = alone_then_batched(build(experts=experts))
    assert asked and all(asked), asked
    assert all(torch.equal(a, b) for a, b in zip(want, got))
