"""The batched decode step with its Triton kernels (interpreter on CPU, real on GPU) against the
same step with the torch `*_ref` kernels: every kernel call of a layer of each kind, with the
arguments the step really passes. The first step of fresh sequences takes identical inputs in
both, so it must agree to fp32 rounding; later steps inherit rounding differences through the
quantization simulations (see tests/test_fast_decoder.py), so they only have to stay close."""

import pytest
import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.config import QuantConfig
from megastep.model.fast import FastDecoder


def tiny_cfg(**kw):
    """The tiny preset with V4's 128-channel FP8 blocks (the Triton FP8 kernels take only those)."""
    return preset("tiny").replace(vocab_size=512, quantization_config=QuantConfig(weight_block_size=(128, 128)), **kw)


def half_cold_placement(cfg):
    """A placement with half of the routed experts (spread over every layer) in host memory."""
    from megastep.runtime.experts import plan_placement, resident_bytes, routed_expert_bytes

    half = cfg.num_hidden_layers * cfg.n_routed_experts // 2
    return plan_placement(cfg, None, resident_bytes(cfg) + half * routed_expert_bytes(cfg))


def test_triton_step_matches_torch_step():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # o_lora_rank 128: wo_a takes the grouped one-launch FP8 path (group rows a multiple of 128)
    cfg = tiny_cfg(o_lora_rank=128)
    w = synthesize_weights(cfg, seed=2, device=dev, include_mtp=False)
    tri = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device=dev, triton=True)
    ref = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device=dev, triton=False)
    for d in (tri, ref):
        d.pools.reset(0), d.pools.reset(1)
    ids = torch.randint(0, 512, (3, 3), generator=torch.Generator().manual_seed(0)).to(dev)
    slots = torch.tensor([0, 1, tri.pools.dummy_slot], device=dev)
    for t in range(3):
        pos = torch.tensor([t, t, 0], device=dev)
        a, b = tri.step(ids[t], pos, slots)[:2], ref.step(ids[t], pos, slots)[:2]
        assert torch.isfinite(a).all()
        if t == 0:
            assert torch.allclose(a, b, atol=1e-5 * b.abs().max().item())
        else:
            assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9


def test_other_fp8_blocks_take_the_torch_linear():
    """A checkpoint whose FP8 blocks are not V4's 128 (the built-in tiny model's 32): the step on
    the kernel path runs (its FP8 linears through the torch twin, the other kernels as usual) and
    its first step agrees with the torch step to fp32 rounding."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = preset("tiny").replace(vocab_size=512)
    assert cfg.quantization_config.weight_block_size == (32, 32)
    w = synthesize_weights(cfg, seed=3, device=dev, include_mtp=False)
    tri = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True)
    ref = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=False)
    assert "shared13" not in tri.layers[0]  # the gated FP8 launch needs 128-blocks
    for d in (tri, ref):
        d.pools.reset(0), d.pools.reset(1)
    ids = torch.tensor([5, 9], device=dev)
    pos = torch.zeros(2, dtype=torch.long, device=dev)
    slots = torch.tensor([0, 1], device=dev)
    a, b = tri.step(ids, pos, slots), ref.step(ids, pos, slots)
    assert torch.isfinite(a).all()
    assert torch.allclose(a, b, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("n", [3, 1])
def test_router_launch_grouping_gives_the_same_bits(n, monkeypatch):
    """The step with the gate GEMV, the routing and the experts' pair grouping in one launch
    (router.gate_route_group, up to MAX_GATE_ROWS rows), with the gate apart and the grouping in
    the router's launch (router.route_group, up to MAX_GROUPED_PAIRS pairs), and with three
    launches gives the same logits, bit for bit, so a batch may cross those sizes freely. One row:
    the one-launch router writes a top-k layer's grouping directly (layer 1; layer 0 is a hash
    layer, grouped as for more rows)."""
    from megastep.kernels import router

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2)
    w = synthesize_weights(cfg, seed=5, device=dev, include_mtp=False)
    ids = torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(2)).to(dev)
    slots = torch.arange(n, device=dev)
    logits = []
    calls = {"gate_route_group": 0}
    fused = router.gate_route_group

    def counted(*a, **k):
        calls["gate_route_group"] += 1
        return fused(*a, **k)

    monkeypatch.setattr(router, "gate_route_group", counted)
    for pairs, rows in ((router.MAX_GROUPED_PAIRS, router.MAX_GATE_ROWS), (router.MAX_GROUPED_PAIRS, 0), (0, 0)):
        monkeypatch.setattr(router, "MAX_GROUPED_PAIRS", pairs)
        monkeypatch.setattr(router, "MAX_GATE_ROWS", rows)
        d = FastDecoder(cfg, w, max_seqs=3, max_ctx=32, device=dev, triton=True)
        for s in range(3):
            d.pools.reset(s)
        logits.append([d.step(ids[t], torch.full((n,), t, device=dev), slots) for t in range(2)])
        if rows:  # the one-launch path really ran (every layer of both steps)
            assert calls["gate_route_group"] == 2 * cfg.num_hidden_layers, calls
    for run in logits[1:]:
        for a, b in zip(logits[0], run):
            assert torch.equal(a, b)


def test_cold_experts_in_host_memory_give_the_same_bits():
    """Issue 4 recipe A: experts the placement marks cold sit in (page-locked, on a GPU) host
    memory and the experts kernel reads them in place through the address table: the logits are
    bit-identical to every expert in device memory."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=3)
    w = synthesize_weights(cfg, seed=4, device=dev, include_mtp=False)
    plan = half_cold_placement(cfg)
    assert plan.n_cold == cfg.num_hidden_layers * cfg.n_routed_experts // 2 and all(plan.cold(L) for L in range(cfg.num_hidden_layers))
    hot = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True)
    split = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True, placement=plan)
    if dev == "cuda":  # the cold experts really are in page-locked host memory
        tab = split.layers[0]["experts"]
        e = plan.cold(0)[0]
        assert not tab.tensors[e][0].is_cuda and tab.tensors[e][0].is_pinned()
    ids = torch.randint(0, 512, (2, 2), generator=torch.Generator().manual_seed(1)).to(dev)
    slots = torch.tensor([0, 1], device=dev)
    for d in (hot, split):
        d.pools.reset(0), d.pools.reset(1)
    for t in range(2):
        pos = torch.tensor([t, t], device=dev)
        assert torch.equal(hot.step(ids[t], pos, slots), split.step(ids[t], pos, slots))


def test_triton_block_step_matches_torch_step():
    """Multi-token blocks (several rows of one sequence per step, causal within the block) with
    the Triton kernels against the torch twins: window rings longer than the window, compressor
    passes in block order."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=3)
    w = synthesize_weights(cfg, seed=6, device=dev, include_mtp=False)
    tri = FastDecoder(cfg, w, max_seqs=2, max_ctx=64, device=dev, triton=True, max_block=4)
    ref = FastDecoder(cfg, w, max_seqs=2, max_ctx=64, device=dev, triton=False, max_block=4)
    for d in (tri, ref):
        d.pools.reset(0), d.pools.reset(1)
    g = torch.Generator().manual_seed(2)
    dummy = tri.pools.dummy_slot
    pa = pb = 0
    for t in range(3):
        # sequence 0: a block of 4 rows (not in position order); sequence 1: one row; one padding row
        pos = torch.tensor([pa + 2, pa, pa + 3, pb, pa + 1, 0])
        slots = torch.tensor([0, 0, 0, 1, 0, dummy])
        ids = torch.randint(0, 512, (6,), generator=g)
        pa, pb = pa + 4, pb + 1
        a = tri.step(ids.to(dev), pos.to(dev), slots.to(dev), block=4)[:5]
        b = ref.step(ids.to(dev), pos.to(dev), slots.to(dev), block=4)[:5]
        assert torch.isfinite(a).all()
        if t == 0:
            # Rows past a block's first read keys this step wrote, and on a GPU the torch twins'
            # matmuls sum in an order that depends on the batch shape: a 1-ulp difference before a
            # bf16 or e4m3 rounding can move a row's logits by up to a bf16 step (seen on an H200:
            # 0.0017 at a logit scale of 3.9 in the lone row of sequence 1).
            assert (a - b).abs().max() <= 1e-2 * b.abs().max()
            assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9999
        else:
            assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9


def test_expert_parallel_with_triton_kernels_matches_one_rank():
    """Expert parallelism through the Triton kernels (sparse address tables, per-pair outputs,
    integer all-reduce, slot-order sum): 2 ranks over gloo give the 1-rank logits bit for bit."""
    if torch.cuda.is_available():
        pytest.skip("gloo ranks on the CPU (the interpreter); the GPU path is NCCL")
    from test_distributed import check_fast_expert_parallel

    cfg = tiny_cfg(num_hidden_layers=3)
    check_fast_expert_parallel(cfg, 2, [torch.bfloat16], [5, 77, 301], 2, triton=True)


def test_moe_mode_knob():
    """The experts kernel mode is a decoder option (the tensor-core "dot" mode here): the first
    step of fresh sequences agrees with the torch twins; an unknown mode is refused."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2)
    w = synthesize_weights(cfg, seed=8, device=dev, include_mtp=False)
    with pytest.raises(ValueError, match="moe_mode"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device=dev, moe_mode="fast")
    tri = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True, moe_mode="dot")
    ref = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=False)
    ids, pos, slots = (torch.tensor(v, device=dev) for v in ([11, 400], [0, 0], [0, 1]))
    a, b = tri.step(ids, pos, slots), ref.step(ids, pos, slots)
    assert torch.allclose(a, b, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("cold_path", ["cpu", "hybrid"])
def test_cold_experts_on_the_cpu(cold_path):
    """Issue 4 recipes B and hybrid: the placement's cold experts (all, or a share) computed by the
    CPU sidecar beside the GPU's experts kernel, the two sets of slot outputs added bit-exactly and
    summed in slot order. The CPU kernel sums in another order than the GPU kernel, so the logits
    agree to rounding (not bitwise) with every expert on the device; the same run twice gives the
    same bits."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=3)
    w = synthesize_weights(cfg, seed=4, device=dev, include_mtp=False)
    plan = half_cold_placement(cfg)
    hot = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True)
    runs = [FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True, placement=plan, cold_path=cold_path)
            for _ in range(2)]
    n_cpu = [len(l) for l in (runs[0].sidecar.layers[L].stacked["w13"] for L in range(cfg.num_hidden_layers))]
    n_cold = [len(plan.cold(L)) for L in range(cfg.num_hidden_layers)]
    assert n_cpu == n_cold if cold_path == "cpu" else all(0 < a < b for a, b in zip(n_cpu, n_cold))
    assert all(runs[0].layers[L]["experts"].sparse for L in range(cfg.num_hidden_layers))
    ids = torch.randint(0, 512, (2, 2), generator=torch.Generator().manual_seed(1)).to(dev)
    slots = torch.tensor([0, 1], device=dev)
    for d in [hot] + runs:
        d.pools.reset(0), d.pools.reset(1)
    for t in range(2):
        pos = torch.tensor([t, t], device=dev)
        want = hot.step(ids[t], pos, slots)
        a, b = (d.step(ids[t], pos, slots) for d in runs)
        assert torch.equal(a, b)
        assert torch.allclose(a, want, atol=2e-2 * want.abs().max().item()), (a - want).abs().max()


def test_shared_expert_in_the_experts_combine_gives_the_same_bits():
    """The shared expert's w2 beside the routed experts with its output added by their combine
    or by the next mHC launch (FastDecoder.shared_w2 "combine" / "mhc"), and the shared expert
    forked after the router or before it (shared_after_router), against w2 after them with the
    routed sum as its residual: the same logits, bit for bit, over steps of 3 rows and of 1. (The
    shared expert's intermediate size 128: one FP8 block, so its w1/w3 take the gated launch the
    path needs.)"""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2, moe_intermediate_size=128)
    w = synthesize_weights(cfg, seed=6, device=dev, include_mtp=False)
    runs = []
    for shared_w2, after_router in (("combine", False), ("mhc", True), ("residual", True), ("residual", False)):
        d = FastDecoder(cfg, w, max_seqs=3, max_ctx=32, device=dev, triton=True, shared_w2=shared_w2,
                        shared_after_router=after_router)
        assert all("shared13" in lw and "experts" in lw for lw in d.layers)
        for s in range(3):
            d.pools.reset(s)
        g = torch.Generator().manual_seed(3)
        out = []
        for t, n in enumerate((3, 1)):  # (the 1-row step reads the 3-row step's state)
            ids = torch.randint(0, 512, (n,), generator=g).to(dev)
            out.append(d.step(ids, torch.full((n,), t, device=dev), torch.arange(n, device=dev)))
        runs.append(out)
    for outs in zip(*runs):
        assert torch.isfinite(outs[0]).all() and all(torch.equal(o, outs[-1]) for o in outs)


def two_steps_each(monkeypatch, cfg, w, setting: str, values, seed: int, calls: list):
    """Two 2-row steps of a fresh decoder (on the kernels) with fast.<setting> at each value:
    ({value: logits}, {value: what `calls` recorded in its steps}, the last decoder)."""
    from megastep.model import fast

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, 512, (2, 2), generator=torch.Generator().manual_seed(seed)).to(dev)
    logits, seen = {}, {}
    for v in values:
        monkeypatch.setattr(fast, setting, v)
        d = FastDecoder(cfg, w, max_seqs=2, max_ctx=32, device=dev, triton=True)
        d.pools.reset(0), d.pools.reset(1)
        calls.clear()
        logits[v] = [d.step(ids[t], torch.full((2,), t, device=dev), torch.arange(2, device=dev)) for t in range(2)]
        seen[v] = list(calls)
    return logits, seen, d


def test_indexer_first_gives_the_same_bits(monkeypatch):
    """fast.INDEXER_FIRST: a CSA layer's bf16 projection in two launches, the indexer's rows (its
    compressor's and weights_proj's) first, each with the whole launch's configuration, gives the
    same logits bit for bit over two steps. (On a GPU the indexer's q rows also move to its stream:
    tests/test_fast_gpu.py.)"""
    from megastep.kernels import dense

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2)
    assert cfg.ratio(1) == 4  # layer 1 is a CSA layer
    w = synthesize_weights(cfg, seed=7, device=dev, include_mtp=False)
    launches = []
    real = dense.linear_bf16

    def spy(x, wt, *a, **k):
        launches.append((wt.shape[0], k.get("config")))
        return real(x, wt, *a, **k)

    monkeypatch.setattr(dense, "linear_bf16", spy)
    logits, seen, d = two_steps_each(monkeypatch, cfg, w, "INDEXER_FIRST", (False, True), 4, launches)
    wd, sizes = d.layers[1]["x_dense"]
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)
    whole = dense.pick_config(*wd.shape)
    idx_rows, comp_rows = sum(sizes[2:]), sizes[0] + sizes[1]
    assert (wd.shape[0], None) in seen[False] and (idx_rows, whole) not in seen[False]
    i = seen[True].index((idx_rows, whole))  # the indexer's rows, then the compressor's, in each step
    assert seen[True][i + 1] == (comp_rows, whole) and seen[True].count((idx_rows, whole)) == 2
    assert (wd.shape[0], None) not in seen[True]


def test_q_norm_in_the_x_launch_gives_the_same_bits(monkeypatch):
    """fast.QNORM_TAIL_ROWS: the q norm made by the x group's launch (linear_fp8(norm_tail=)) instead
    of rms_norm's launch after it gives the same logits bit for bit over two 2-row steps; the steps
    really skip the norm's launch and ask the linear for it."""
    from megastep.kernels import linear_fp8 as lin
    from megastep.kernels import rope_norm as rn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # wq_a and wkv in one launch (each whole 128-row blocks), the tail on whole 64-column tiles
    cfg = tiny_cfg(num_hidden_layers=2, q_lora_rank=128, head_dim=128)
    w = synthesize_weights(cfg, seed=8, device=dev, include_mtp=False)
    calls = []
    real_lin, real_norm = lin.linear_fp8, rn.rms_norm

    def spy_lin(*a, **k):
        calls.append(("linear", k.get("norm_tail") is not None))
        return real_lin(*a, **k)

    def spy_norm(*a, **k):
        calls.append(("rms_norm", True))
        return real_norm(*a, **k)

    monkeypatch.setattr(lin, "linear_fp8", spy_lin)
    monkeypatch.setattr(rn, "rms_norm", spy_norm)
    logits, seen, _ = two_steps_each(monkeypatch, cfg, w, "QNORM_TAIL_ROWS", (0, 2), 5, calls)
    for a, b in zip(logits[0], logits[2]):
        assert torch.equal(a, b)
    assert ("rms_norm", True) in seen[0] and ("linear", True) not in seen[0]
    assert ("rms_norm", True) not in seen[2] and seen[2].count(("linear", True)) == 2 * 2  # 2 layers x 2 steps


def test_wo_b_partials_summed_by_the_mixes_give_the_same_bits(monkeypatch):
    """fast.WO_B_PARTS_ROWS: wo_b's split-K partials left unsummed (linear_fp8_splits) and summed in
    split order by the next mixes launch give the same logits bit for bit over two 2-row steps as
    wo_b's own combine; the steps really take the partials (one call a layer and step)."""
    from megastep.kernels import linear_fp8 as lin

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2, o_lora_rank=128)  # wo_b: K = 2 x 128 in 2 splits at 2 rows
    K, N = cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size
    full = lin.pick_config(2, N, K)
    assert K // lin.split_cols(K, full) == 2
    w = synthesize_weights(cfg, seed=9, device=dev, include_mtp=False)
    calls = []
    real = lin.linear_fp8_splits

    def spy(*a, **k):
        calls.append(("splits", a[1].shape))
        return real(*a, **k)

    monkeypatch.setattr(lin, "linear_fp8_splits", spy)
    logits, seen, _ = two_steps_each(monkeypatch, cfg, w, "WO_B_PARTS_ROWS", (0, 2), 6, calls)
    for a, b in zip(logits[0], logits[2]):
        assert torch.equal(a, b)
    assert seen[0] == [] and seen[2] == [("splits", (N, K))] * (2 * 2)  # 2 layers x 2 steps


def test_expert_pairs_summed_by_the_mixes_give_the_same_bits(monkeypatch):
    """fast.MOE_PAIRS_ROWS: the routed experts' per-slot outputs left unsummed and summed in slot order by
    the next mixes launch, the shared expert's output added there, give the same logits bit for bit over
    two 2-row steps as the experts' own combine; the steps really ask for the pairs (a layer and step each)."""
    from megastep.kernels import moe

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_cfg(num_hidden_layers=2, moe_intermediate_size=128)  # the gated shared launch: "mhc" takes it
    w = synthesize_weights(cfg, seed=10, device=dev, include_mtp=False)
    calls = []
    real = moe.moe_experts_table

    def spy(*a, **k):
        calls.append(("pairs", bool(k.get("return_pairs"))))
        return real(*a, **k)

    monkeypatch.setattr(moe, "moe_experts_table", spy)
    logits, seen, _ = two_steps_each(monkeypatch, cfg, w, "MOE_PAIRS_ROWS", (0, 2), 7, calls)
    for a, b in zip(logits[0], logits[2]):
        assert torch.equal(a, b)
    assert seen[0] == [("pairs", False)] * 4 and seen[2] == [("pairs", True)] * 4  # 2 layers x 2 steps
