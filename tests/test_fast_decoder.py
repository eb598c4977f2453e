"""The batched static-shape decode step (model/fast.py) against the reference decode, on CPU
(kernels replaced by their torch `*_ref` twins).

Two regimes:
- simulations off in both (the fp8/fp4 activation simulations patched to identity) and fp32
  activations: the two differ by fp32 summation order only (batched vs single-row matmuls), so
  logits must agree to 1e-4 of their scale at every step for every row, with rows at different
  positions, a padding row, and a slot reused.
- the default (bf16 activations, simulations on): a 1-ulp difference in the bf16 residual stream
  or before an fp8 rounding moves values by a whole bf16/e4m3 step, which the following layers
  carry on, so the paths agree statistically, not bitwise (measured: median ~1e-3 of the scale).
"""

import pytest
import torch

from megastep.checkpoint import formats
from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.config import QuantConfig
from megastep.kernels import linear_fp8, moe
from megastep.model import ops
from megastep.model.fast import FastDecoder
from megastep.model.reference import ReferenceModel

VOCAB = 1024


@pytest.fixture(scope="module")
def tiny():
    # 128-channel quantization blocks as in V4 (the Triton kernels support only those)
    cfg = preset("tiny").replace(vocab_size=VOCAB, quantization_config=QuantConfig(weight_block_size=(128, 128)))
    return cfg, synthesize_weights(cfg, seed=2, include_mtp=False)


@pytest.fixture
def sims_off(monkeypatch):
    ident = lambda x, *a, **k: x  # noqa: E731
    for mod in (formats, linear_fp8.formats, moe.formats):
        monkeypatch.setattr(mod, "fp8_act_sim", ident)
    monkeypatch.setattr(ops, "kv_sim", ident)
    monkeypatch.setattr(ops, "index_sim", ident)


def drive(cfg, weights, schedule, max_seqs=4, dtype=torch.bfloat16, block=1, shuffle=False):
    """Run both implementations over `schedule`: a list of steps, each a list of (seq, token).
    A seq id seen for the first time starts a fresh sequence in the next free slot. A seq may
    have several rows in a step (a multi-token block, up to `block`): they take its next
    positions in order; shuffle=True then permutes the step's rows (a block's rows need not be
    adjacent or in position order). Returns the per-row max |logit diff| and the logit scale."""
    ref = ReferenceModel(cfg, weights, dtype=dtype)  # simulations as patched (or not) by the test
    fast = FastDecoder(cfg, weights, max_seqs=max_seqs, max_ctx=256, device="cpu", dtype=dtype, max_block=block)
    slot_of, state_of, pos_of, diffs, scale = {}, {}, {}, [], 0.0
    for step in schedule:
        for s, _ in step:
            if s not in slot_of:
                free = sorted(set(range(max_seqs)) - set(slot_of.values()))[0]
                slot_of[s], state_of[s], pos_of[s] = free, ref.new_state(), 0
                fast.pools.reset(free)
        # one padding row pointing at the dummy slot, as a graph bucket would add
        tokens = torch.tensor([t for _, t in step] + [0])
        row_pos = []
        for s, _ in step:
            row_pos.append(pos_of[s])
            pos_of[s] += 1
        pos = torch.tensor(row_pos + [0])
        slots = torch.tensor([slot_of[s] for s, _ in step] + [fast.pools.dummy_slot])
        perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(len(diffs))) if shuffle \
            else torch.arange(len(tokens))
        out = torch.empty(len(tokens), cfg.vocab_size, dtype=torch.float32)
        out[perm] = fast.step(tokens[perm], pos[perm], slots[perm], block=block)
        for j, (s, t) in enumerate(step):
            want = ref.forward(state_of[s], [t])[0]
            diffs.append((out[j] - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
    return diffs, scale


def schedule_three_sequences(n_steps=60, seed=0):
    """Sequences joining and leaving: A from step 0, B from step 5, C from step 20; A leaves at 45
    and D takes its slot."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda: int(torch.randint(0, VOCAB, (1,), generator=g))  # noqa: E731
    sched = []
    for t in range(n_steps):
        step = []
        if t < 45:
            step.append(("A", tok()))
        if t >= 5:
            step.append(("B", tok()))
        if t >= 20:
            step.append(("C", tok()))
        if t >= 45:
            step.append(("D", tok()))
        sched.append(step)
    return sched


def schedule_blocks(n_steps=24, seed=3, block=4):
    """Multi-token blocks: A advances by a block of 1..`block` tokens every step (rows in a
    shuffled order), B one token per step, C joins at step 8 with a full block each step."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda: int(torch.randint(0, VOCAB, (1,), generator=g))  # noqa: E731
    sched = []
    for t in range(n_steps):
        k = 1 + t % block
        rows = [("A", tok()) for _ in range(k)] + [("B", tok())]
        if t >= 8:
            rows += [("C", tok()) for _ in range(block)]
        sched.append(rows)
    return sched


def test_matches_reference_with_simulations_off(tiny, sims_off):
    cfg, w = tiny
    diffs, scale = drive(cfg, w, schedule_three_sequences(), dtype=torch.float32)
    assert scale > 1.0
    assert max(diffs) <= 1e-4 * scale, f"max diff {max(diffs)} at row-step {diffs.index(max(diffs))}"


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
def test_multi_token_blocks_match_reference_with_simulations_off(tiny, sims_off, shuffle):
    """Several rows of one sequence in a step (causal within the block) give what decoding the
    tokens one by one gives: rings longer than the window keep the block's earlier keys, and
    the compressors advance in block order."""
    cfg, w = tiny
    sched = schedule_blocks()
    assert sum(len(s) for s in sched) > 2 * len(sched) and cfg.sliding_window < 24 * 2  # rings wrap
    diffs, scale = drive(cfg, w, sched, dtype=torch.float32, block=4, shuffle=shuffle)
    assert scale > 1.0
    assert max(diffs) <= 1e-4 * scale, f"max diff {max(diffs)} at row {diffs.index(max(diffs))}"


def test_block_larger_than_allowed_is_refused(tiny):
    cfg, w = tiny
    fast = FastDecoder(cfg, w, max_seqs=2, max_ctx=64, device="cpu", max_block=2)
    with pytest.raises(ValueError, match="max_block"):
        fast.step(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), block=3)


def test_second_stream_only_on_cuda(tiny):
    """overlap (the side stream) needs CUDA and the Triton kernels: on CPU it is off by default
    and asking for it is one clear error."""
    cfg, w = tiny
    assert FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu").side_stream is None
    with pytest.raises(ValueError, match="overlap needs"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", overlap=True)


def test_lut_experts_only_where_they_run(tiny):
    """The CUDA "lut" experts are the default only where they run (a CUDA device, nvcc, sizes
    multiple of 512): on CPU the decoder keeps the Triton kernels' pick, and asking for "lut" is
    one clear error, as is an unknown mode."""
    cfg, w = tiny
    assert FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu").moe_mode is None
    with pytest.raises(ValueError, match="moe_mode 'lut' needs"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", moe_mode="lut")
    with pytest.raises(ValueError, match="moe_mode must be one of"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", moe_mode="fast")


def test_cuda_routing_only_where_it_runs(tiny):
    """The one-launch CUDA routing is taken only where it runs: on CPU the decoder keeps router.py's
    kernels whatever the rows, and asking for it, or for an unknown router, is one clear error."""
    cfg, w = tiny
    d = FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu")
    assert not d.route_cuda_ok and all(d._moe_plan(n)[0] == "triton" for n in (1, 4, 16, 64))
    with pytest.raises(ValueError, match="router 'cuda' needs"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", router="cuda")
    with pytest.raises(ValueError, match="router must be cuda or triton"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", router="fast")


def test_moe_plan_by_rows(tiny):
    """router=None / shared_after_router=None / shared_w2=None follow MOE_PLAN by a step's rows on
    one GPU (with several ranks MOE_PLAN_EP under the peer-to-peer combine, else MOE_PLAN_ABOVE);
    explicit choices hold for every row count."""
    from megastep.model.fast import MOE_PLAN, MOE_PLAN_ABOVE, MOE_PLAN_EP

    cfg, w = tiny
    d = FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu")
    d.route_cuda_ok = True  # as on a GPU that runs it
    assert [d._moe_plan(n) for n in (1, 2, 4, 5, 16, 17, 64, 65)] == [
        ("cuda", True, "mhc"), ("cuda", True, "mhc"), ("cuda", True, "mhc"), ("cuda", False, "mhc"),
        ("cuda", False, "mhc"), ("cuda", False, "residual"), ("cuda", False, "residual"), MOE_PLAN_ABOVE]
    assert MOE_PLAN_ABOVE == ("triton", False, "residual") and [p[0] for p in MOE_PLAN] == [1, 4, 16, 64]
    d.route_cuda_ok = False  # where the CUDA routing does not run: router.py's, the rest of the plan kept
    assert d._moe_plan(1) == ("triton", True, "mhc")
    d.route_cuda_ok = True
    d.world_size = 2  # expert parallelism, the all-reduce combine: the order measured there, whatever the rows
    assert d.peer is None and {d._moe_plan(n) for n in (1, 4, 16, 64)} == {MOE_PLAN_ABOVE}
    d.peer = object()  # the peer-to-peer combine: the CUDA routing and the late fork at 1 and 7-16 rows
    assert MOE_PLAN_EP == ((1, "cuda", True, "residual"), (6, *MOE_PLAN_ABOVE), (16, "cuda", True, "residual"))
    late = ("cuda", True, "residual")
    assert [d._moe_plan(n) for n in (1, 2, 6, 7, 16, 17, 64)] == [late, MOE_PLAN_ABOVE, MOE_PLAN_ABOVE, late, late,
                                                                  MOE_PLAN_ABOVE, MOE_PLAN_ABOVE]
    d.route_cuda_ok = False
    assert d._moe_plan(1) == ("triton", True, "residual")
    d.route_cuda_ok = True
    d.router, d.shared_after_router, d.shared_w2 = "cuda", False, "combine"
    assert {d._moe_plan(n) for n in (1, 4, 64)} == {("cuda", False, "combine")}
    with pytest.raises(ValueError, match="shared_w2 must be residual, combine or mhc"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=32, device="cpu", shared_w2="side")


def test_workspace_lanes_are_separate_buffers():
    """Kernels launched on the side stream (lane "side") never share split-K partials or arrival
    counters with the main stream's kernels running at the same time."""
    from megastep.kernels.common import lane, workspace

    main = workspace(torch.device("cpu"), "counters_lane_test", 8, torch.int32)
    with lane("side"):
        side = workspace(torch.device("cpu"), "counters_lane_test", 8, torch.int32)
        assert workspace(torch.device("cpu"), "counters_lane_test", 8, torch.int32) is side
    assert side.data_ptr() != main.data_ptr()
    assert workspace(torch.device("cpu"), "counters_lane_test", 8, torch.int32) is main
    assert not side.any() and not main.any()


def test_agrees_with_reference_with_simulations_on(tiny):
    cfg, w = tiny
    diffs, scale = drive(cfg, w, schedule_three_sequences(40, seed=1))
    d = torch.tensor(diffs)
    assert d[:5].max() <= 1e-6 * scale  # a lone row at the first positions: head rounding only
    # a diverged residual can flip a discrete choice (an expert, an indexer entry) now and then,
    # so bound the bulk, not the worst step; the logic itself is pinned by the sims-off test
    assert d.median() <= 1e-2 * scale and d.quantile(0.9) <= 0.1 * scale


def test_slot_state_is_isolated(tiny):
    """A row's output depends only on its own slot: the same sequence next to two padding rows
    (writing to the dummy slot) gives the same logits, bit for bit, whatever those rows hold (other
    tokens at other positions, at every step). The batch shape is the same in both runs because CPU
    torch matmuls are not batch-invariant: a row alone differs from the same row in a batch by
    ~1e-7 of the scale, which can flip an expert or indexer choice a few steps later (seen at step
    19 on an AVX-512 Intel CPU, not on an AMD one). Alone against batched is
    test_matches_reference_with_simulations_off's, in fp32 with the simulations off."""
    cfg, w = tiny
    fast1 = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device="cpu")
    fast2 = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device="cpu")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (24,), generator=gen)
    pads = torch.randint(0, VOCAB, (24, 2, 2), generator=gen)
    for f in (fast1, fast2):
        f.pools.reset(1)
    slots = torch.tensor([1, fast1.pools.dummy_slot, fast1.pools.dummy_slot])
    for t in range(24):
        a = fast1.step(torch.cat([ids[t : t + 1], pads[t, 0]]), torch.tensor([t, t, 0]), slots)
        b = fast2.step(torch.cat([ids[t : t + 1], pads[t, 1]]), torch.tensor([t, 3 + t, 40]), slots)
        assert not torch.equal(a[1:], b[1:]), t  # the padding rows really differ
        assert torch.equal(a[0], b[0]), t


def test_routed_reads_count_what_the_rows_route_to(tiny, monkeypatch):
    """`megastep bench`'s count of the routed experts its rows read (bench.routed_reads): every MoE
    layer once per step, a row's k experts distinct, and split by the placement. Layer 0 is a hash
    layer, so its experts are known without the router: tid2eid of the rows' tokens. Made cold, they
    are exactly what is counted cold."""
    from megastep import bench
    from megastep.kernels import moe_lut
    from megastep.runtime.experts import Placement

    cfg, w = tiny
    L, E, k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    assert cfg.num_hash_layers >= 1
    dec = FastDecoder(cfg, w, max_seqs=4, max_ctx=32, device="cpu")

    def placement(cold: set) -> Placement:  # every (layer, expert) in HBM but `cold`
        pairs = [(layer, e) for layer in range(L) for e in range(E)]
        order = tuple(p for p in pairs if p not in cold) + tuple(sorted(cold))
        return Placement(L, E, k, 1, 0, L * E, order, L * E - len(cold), tuple((1 / E,) * E for _ in range(L)))

    monkeypatch.setattr(moe_lut, "GATE_UP_GM", False)  # (first the pair-major kernels' passes: 2 pairs each)
    monkeypatch.setattr(moe_lut, "DOWN_GM", False)
    one = bench.routed_reads(dec, placement(set()), 1, 8, steps=2)
    assert one == {"steps": 2, "hot_per_step": [L * k] * 2, "cold_per_step": [0, 0], "passes_per_step": [L * k] * 2,
                   "down_passes_per_step": [L * k] * 2, "down_pairs_per_pass": 2, "pairs_per_pass": 2,
                   "most_pairs": [1, 1]}  # one row: one pair an expert, one pass each
    assert dec.route_log is None  # off again: a graph captured later clones nothing
    tokens = bench._tokens(3, torch.device("cpu"))
    hashed = {(0, e) for e in w["layers.0.ffn.gate.tid2eid"][tokens].flatten().tolist()}
    three = bench.routed_reads(dec, placement(hashed), 3, 8, steps=2)
    assert three["cold_per_step"] == [len(hashed)] * 2
    assert all(k * L <= h + c <= L * min(E, 3 * k) for h, c in zip(three["hot_per_step"], three["cold_per_step"]))
    # 3 rows: an expert holds 1-3 pairs, so 1 or 2 passes (3 L k pairs in all)
    for h, c, n, most in zip(three["hot_per_step"], three["cold_per_step"], three["passes_per_step"],
                             three["most_pairs"]):
        assert h + c <= n <= 3 * L * k and 1 <= most <= 3
        assert (n > h + c) == (most == 3)  # a second pass only for an expert all 3 rows route to
    assert three["down_passes_per_step"] == three["passes_per_step"] and three["down_pairs_per_pass"] == 2
    # from moe_lut.DOWN4_MIN_ROWS rows on, down's passes take 4 pairs: 3 rows route at most 3 to an expert
    monkeypatch.setattr(moe_lut, "DOWN4_MIN_ROWS", 3)
    wide = bench.routed_reads(dec, placement(hashed), 3, 8, steps=2)
    assert wide["down_pairs_per_pass"] == 4
    for h, c, n, d, most in zip(wide["hot_per_step"], wide["cold_per_step"], wide["passes_per_step"],
                                wide["down_passes_per_step"], wide["most_pairs"]):
        assert d == h + c and (n > h + c) == (most == 3)  # down: one pass an expert; gate-up as before
    # the group-major gate-up and down (moe_lut.GATE_UP_GM, DOWN_GM) take 8 pairs a pass: one an expert here too
    monkeypatch.setattr(moe_lut, "GATE_UP_GM", True)
    monkeypatch.setattr(moe_lut, "DOWN_GM", True)
    gm = bench.routed_reads(dec, placement(hashed), 3, 8, steps=2)
    assert gm["pairs_per_pass"] == gm["down_pairs_per_pass"] == 8
    assert all(n == d == h + c for h, c, n, d in zip(gm["hot_per_step"], gm["cold_per_step"], gm["passes_per_step"],
                                                      gm["down_passes_per_step"]))


def test_expert_passes_count_two_pairs_a_pass():
    """The "lut" kernels stream an expert's rows once for every 2 of its pairs (moe_lut.PAIRS_PER_PASS)."""
    from megastep import bench
    from megastep.kernels import moe_lut

    assert moe_lut.PAIRS_PER_PASS == 2
    assert bench.expert_passes([]) == 0
    assert bench.expert_passes([1, 2, 3, 4, 5, 9]) == 1 + 1 + 2 + 2 + 3 + 5
    assert bench.expert_passes([1, 2, 3, 4, 5], 4) == 1 + 1 + 1 + 1 + 2  # (benchmarks/expert_passes.py's wider passes)


def test_consume_drops_a_layers_expert_tensors_before_placing_them(tiny, monkeypatch):
    """With consume=True the per-expert tensors of a layer are gone once they are stacked, so placing
    the stack holds at most two copies of a layer's experts (`--hbm-budget auto` reserves two);
    without consume the caller's dict keeps them."""
    from megastep.model.moe_sublayer import MoeSublayer

    cfg, w = tiny
    left = {}
    place = MoeSublayer._place_experts

    def spy(self, L, st, cold, cpu):
        left[L] = [k for k in weights if k.startswith(f"layers.{L}.ffn.experts.")]
        return place(self, L, st, cold, cpu)

    monkeypatch.setattr(MoeSublayer, "_place_experts", spy)
    for consume in (True, False):
        weights = dict(w)
        left.clear()
        FastDecoder(cfg, weights, max_seqs=1, max_ctx=32, device="cpu", triton=True, consume=consume)
        assert sorted(left) == list(range(cfg.num_hidden_layers))
        assert all((not keys) == consume for keys in left.values()), {L: len(k) for L, k in left.items()}
