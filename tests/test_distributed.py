"""Expert parallelism over gloo on the CPU (issue 6): W ranks give the 1-rank reference's logits bit for
bit and the same greedy tokens; bad world sizes are refused clearly; launched processes always exit."""

import time

import pytest
import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.errors import UserError
from megastep.model.reference import ReferenceModel
from megastep.runtime import distributed as D

SEED = 3
PROMPT = [5, 77, 301, 12, 499, 0, 256, 42]
STEPS = 20
TIMEOUT_S = 45  # per launch; a healthy run takes a few seconds


def _cfg(top_k: int = 2):
    # tiny: 4 layers (SWA, CSA, HCA, CSA), layer 0 hash-routed, 8 experts top-2 (top-k as asked).
    return preset("tiny").replace(vocab_size=512, num_experts_per_tok=top_k)


def _greedy(model, prompt, steps):
    """Prompt, then `steps` greedy tokens; returns (all logits [P+steps, V], generated tokens)."""
    st = model.new_state()
    rows = [model.forward(st, prompt)]
    toks = []
    for _ in range(steps):
        toks.append(int(rows[-1][-1].argmax()))
        rows.append(model.forward(st, [toks[-1]]))
    return torch.cat(rows), toks


def _ep_rank(r: D.Rank, seed, prompt, steps, cases):
    runs, held = {}, None
    for top_k, dtype in cases:
        cfg = _cfg(top_k)
        w = D.synthesize_rank_weights(cfg, seed, r.rank, r.world_size, device=r.device)
        held = sorted({D.expert_id(n) for n in w} - {None})
        model = D.ExpertParallelReference(cfg, w, rank=r.rank, world_size=r.world_size, dtype=dtype)
        runs[top_k, dtype] = _greedy(model, prompt, steps)
    # The combine on the backend itself: each row written by one rank arrives bit for bit, awkward
    # values included, through the int32 path (even row bytes) and the uint8 path (D=3).
    combined = []
    for d in (6, 3):
        buf = torch.zeros(r.world_size, d, dtype=torch.bfloat16)
        buf[r.rank] = _special(r.rank)[:d]
        D.ordered_combine(buf)
        combined.append(buf)
    return {"runs": runs, "held": held, "combine": combined}


def _special(rank: int) -> torch.Tensor:
    """-0.0, a subnormal, a NaN with a payload, inf, and rank-dependent normal values (bf16)."""
    bits = torch.tensor([0x8000, 0x0001, 0x7FC5, 0x7F80, 0x3F81 + rank, 0xC2A0 - rank], dtype=torch.int32)
    return bits.to(torch.int16).view(torch.bfloat16)


class SlotOrderReference(ReferenceModel):
    """The reference with routed experts summed in routing-slot order instead of expert id: what a
    combine that does not fix the order could produce."""

    def moe(self, x, L, token):
        p = f"layers.{L}.ffn"
        idx, w = self.route(x, L, token)
        y = torch.zeros(x.shape[-1], dtype=torch.float32)
        for slot in range(len(idx)):
            y += self.expert(x, f"{p}.experts.{int(idx[slot])}", w[slot]).float()
        y += self.expert(x, p + ".shared_experts").float()
        return y.to(x.dtype)


_references = {}


def _reference(top_k, dtype):
    if (top_k, dtype) not in _references:
        cfg = _cfg(top_k)
        model = ReferenceModel(cfg, synthesize_weights(cfg, SEED, include_mtp=False), dtype=dtype)
        _references[top_k, dtype] = _greedy(model, PROMPT, STEPS)
    return _references[top_k, dtype]


def test_the_parity_check_sees_summation_order():
    """In bf16 a few bf16 expert outputs add exactly in fp32, so any order gives the same bits; with
    fp32 activations and top-4 it does not: there the EP test below would catch a wrong order."""
    cfg = _cfg(4)
    w = synthesize_weights(cfg, SEED, include_mtp=False)
    m = SlotOrderReference(cfg, w, dtype=torch.float32)
    logits = m.forward(m.new_state(), PROMPT + _reference(4, torch.float32)[1])
    assert not torch.equal(logits, _reference(4, torch.float32)[0])


# (top_k, activation dtype): the tiny model as it is (bf16, top-2), and fp32 top-4, where the order
# of the expert sum shows in the bits. One launch runs both (starting ranks costs more than decoding).
CASES = [(2, torch.bfloat16), (4, torch.float32)]


@pytest.mark.parametrize("world", [4, 2])
def test_expert_parallel_matches_one_rank(world):
    t0 = time.monotonic()
    outs = D.launch(_ep_rank, world, (SEED, PROMPT, STEPS, CASES), backend="gloo", threads=1, timeout_s=TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S
    per = 8 // world
    for rank, o in enumerate(outs):
        assert o["held"] == list(range(rank * per, (rank + 1) * per))  # only its own experts loaded
        for case in CASES:
            ref_logits, ref_tokens = _reference(*case)
            logits, tokens = o["runs"][case]
            assert torch.equal(logits, ref_logits), f"rank {rank} of {world}, {case}: logits differ from 1 rank"
            assert tokens == ref_tokens
            assert len(set(ref_tokens)) > 3  # the greedy run is not degenerate
        for d, buf in zip((6, 3), o["combine"]):
            want = torch.stack([_special(q)[:d] for q in range(world)])
            assert torch.equal(buf.view(torch.int16), want.view(torch.int16))  # bits, not values


def test_one_rank_without_process_group_is_the_reference():
    cfg = _cfg()
    w = synthesize_weights(cfg, SEED, include_mtp=False)
    logits, toks = _greedy(D.ExpertParallelReference(cfg, w), PROMPT, 6)
    assert torch.equal(logits, _reference(2, torch.bfloat16)[0][: len(PROMPT) + 6])


def test_rank_weights_match_full_weights():
    cfg = _cfg()
    full = synthesize_weights(cfg, SEED, include_mtp=False)
    mine = D.synthesize_rank_weights(cfg, SEED, 1, 4)
    assert set(mine) == set(D.rank_weights(full, 1, 4, 8))
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # fp8/e8m0 compare as bytes
    assert all(torch.equal(raw(mine[n]), raw(full[n])) for n in mine)
    assert {D.expert_id(n) for n in mine} == {None, 2, 3}
    assert "layers.0.ffn.gate.tid2eid" in mine and "layers.3.ffn.shared_experts.w2.weight" in mine


def test_load_rank_checkpoint_reads_only_its_experts(tmp_path):
    from megastep.checkpoint.synthetic import write_checkpoint

    cfg = _cfg()
    write_checkpoint(cfg, tmp_path, SEED, include_mtp=False, tokenizer="none")
    got_cfg, mine = D.load_rank_checkpoint(tmp_path, 3, 4)
    want = D.synthesize_rank_weights(cfg, SEED, 3, 4)
    assert got_cfg == cfg and list(mine) == list(want)
    assert all(torch.equal(mine[n].view(torch.uint8), want[n].view(torch.uint8)) for n in mine)
    with pytest.raises(UserError, match="over 3 ranks"):
        D.load_rank_checkpoint(tmp_path, 0, 3)


@pytest.mark.parametrize("world", [3, 5, 16, 0])
def test_bad_world_size_is_a_clear_error(world):
    cfg = _cfg()
    with pytest.raises(UserError, match="routed experts|at least 1 rank"):
        D.experts_of(0, world, cfg.n_routed_experts)
    with pytest.raises(UserError):
        D.ExpertParallelReference(cfg, {}, rank=0, world_size=world)
    if world == 3:
        with pytest.raises(UserError, match="cannot split 8 routed experts evenly over 3 ranks.*1, 2, 4, 8"):
            D.synthesize_rank_weights(cfg, SEED, 0, world)


def test_bad_gpus_spec():
    assert D.parse_gpus("0,1,2,3") == [0, 1, 2, 3]
    for bad in ("", "0,0", "a,b", "-1"):
        with pytest.raises(UserError):
            D.parse_gpus(bad)


def _fails_on_rank1(r: D.Rank):
    if r.rank == 1:
        raise UserError("bad checkpoint on rank 1")
    torch.distributed.barrier()  # would wait forever for rank 1: launch must stop it


def _hangs(r: D.Rank):
    time.sleep(600)


def test_failures_and_hangs_end_every_process():
    import multiprocessing

    t0 = time.monotonic()
    with pytest.raises(UserError, match="bad checkpoint on rank 1") as e:
        D.launch(_fails_on_rank1, 2, backend="gloo", threads=1, timeout_s=TIMEOUT_S)
    assert any("raised on rank 1 of 2" in n for n in e.value.__notes__)
    with pytest.raises(TimeoutError, match="did not finish within 4 s"):
        D.launch(_hangs, 2, backend="gloo", threads=1, timeout_s=4)
    assert time.monotonic() - t0 < TIMEOUT_S
    assert multiprocessing.active_children() == []


# ---- the fast path (model/fast.py) with expert parallelism -------------------------------------
def fast_greedy(dec, prompt, steps):
    """One sequence in slot 0: prompt token by token, then greedy; (logits [P+steps, V], tokens)."""
    dec.pools.reset(0)
    rows, toks, pos = [], [], 0
    for tok in prompt + [None] * steps:
        t = tok if tok is not None else toks[-1]
        lg = dec.step(torch.tensor([t]), torch.tensor([pos]), torch.tensor([0]))
        rows.append(lg[0].clone())
        pos += 1
        if tok is None or pos == len(prompt):
            toks.append(int(lg[0].argmax()))
    return torch.stack(rows), toks[:steps]


def fast_ep_rank(r: D.Rank, cfg, seed, prompt, steps, dtypes, triton):
    """A rank's fast decoder on its share of the experts; greedy runs per activation dtype."""
    from megastep.model.fast import FastDecoder

    out = {}
    for dtype in dtypes:
        w = D.synthesize_rank_weights(cfg, seed, r.rank, r.world_size, device=r.device)
        dec = FastDecoder(cfg, w, max_seqs=1, max_ctx=64, device=r.device, dtype=dtype, triton=triton,
                          rank=r.rank, world_size=r.world_size)
        out[dtype] = fast_greedy(dec, prompt, steps)
    return out


def check_fast_expert_parallel(cfg, world, dtypes, prompt, steps, triton):
    """Every rank's logits equal the 1-rank fast decoder's bit for bit, and so do greedy tokens."""
    from megastep.model.fast import FastDecoder

    outs = D.launch(fast_ep_rank, world, (cfg, SEED, prompt, steps, dtypes, triton), backend="gloo", threads=1,
                    timeout_s=TIMEOUT_S * 3)
    torch.set_num_threads(1)  # the ranks' thread count: CPU matmul results can depend on it
    for dtype in dtypes:
        one = FastDecoder(cfg, synthesize_weights(cfg, SEED, include_mtp=False), max_seqs=1, max_ctx=64, device="cpu",
                          dtype=dtype, triton=triton)
        want_logits, want_tokens = fast_greedy(one, prompt, steps)
        for rank, o in enumerate(outs):
            logits, tokens = o[dtype]
            assert torch.equal(logits, want_logits), f"rank {rank} of {world}, {dtype}: logits differ from 1 rank"
            assert tokens == want_tokens


def test_fast_path_expert_parallel_matches_one_rank():
    """The fast decoder (torch twins of the kernels) with experts sharded over 4 ranks, top-4 with
    fp32 activations (where the order of the expert sum shows in the bits) and bf16."""
    check_fast_expert_parallel(_cfg(4), 4, [torch.float32, torch.bfloat16], PROMPT, 12, triton=False)


def test_ep_combine_choice_is_checked():
    """The peer-to-peer combine needs CUDA devices: asked for on the CPU it is refused clearly, as
    is an unknown combine; one rank needs neither."""
    from megastep.model.fast import FastDecoder

    cfg = _cfg()
    w = synthesize_weights(cfg, SEED, include_mtp=False)
    with pytest.raises(ValueError, match="p2p needs the Triton kernels on CUDA"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=64, device="cpu", triton=False, ep_combine="p2p")
    with pytest.raises(ValueError, match="must be p2p or allreduce"):
        FastDecoder(cfg, w, max_seqs=1, max_ctx=64, device="cpu", triton=False, ep_combine="nvlink")
    assert FastDecoder(cfg, w, max_seqs=1, max_ctx=64, device="cpu", triton=False, ep_combine="allreduce").peer is None


# ---- the engine behind the server: rank 0 drives, the others follow ------------------------------
def _engine_greedy(eng, prompts, steps):
    """Prompts prefilled together (multi-token blocks), then greedy decode of every sequence in
    shared steps; then one sequence is freed and its slot reused (its reset must reach every rank).
    Returns (tokens per sequence, every step's logits, the reused slot's first logits)."""
    seqs = [eng.new_sequence() for _ in prompts]
    outs = eng.forward_batch([(s, p) for s, p in zip(seqs, prompts)])
    toks, logits = [[int(o.argmax())] for o in outs], [torch.stack(outs)]
    for _ in range(steps):
        outs = eng.forward_batch([(s, [t[-1]]) for s, t in zip(seqs, toks)])
        logits.append(torch.stack(outs))
        for t, o in zip(toks, outs):
            t.append(int(o.argmax()))
    eng.free(seqs[0])
    again = eng.new_sequence()
    first = eng.forward_batch([(again, prompts[0])])[0]
    return toks, torch.stack(logits), first


def _engine_rank(r: D.Rank, model_dir, prompts, steps):
    from megastep.runtime.engine import FastEngine

    eng = FastEngine(model_dir, device="cpu", max_seqs=2, max_ctx=64, max_block=4, rank=r.rank,
                     world_size=r.world_size)
    if r.rank:
        eng.follow()
        return None
    try:
        return _engine_greedy(eng, prompts, steps)
    finally:
        eng.close()


@pytest.mark.parametrize("world", [2, 4])
def test_engine_expert_parallel_matches_one_rank(tmp_path, world):
    """FastEngine over 2 and 4 ranks (what `megastep serve --gpus` runs, here on gloo): rank 0 takes
    the scheduler's calls and sends each slot reset and step to the others; tokens and logits
    equal the 1-rank engine's bit for bit, and every rank exits when rank 0 closes."""
    from megastep.checkpoint.synthetic import write_checkpoint
    from megastep.config import QuantConfig
    from megastep.runtime.engine import FastEngine

    cfg = _cfg().replace(quantization_config=QuantConfig(weight_block_size=(128, 128)))
    write_checkpoint(cfg, tmp_path, seed=SEED)
    prompts = [PROMPT[:6], PROMPT[2:5]]
    outs = D.launch(_engine_rank, world, (tmp_path, prompts, 6), backend="gloo", threads=1, timeout_s=TIMEOUT_S * 2)
    assert all(o is None for o in outs[1:])
    torch.set_num_threads(1)
    want = _engine_greedy(FastEngine(tmp_path, device="cpu", max_seqs=2, max_ctx=64, max_block=4), prompts, 6)
    toks, logits, first = outs[0]
    assert toks == want[0]
    assert torch.equal(logits, want[1]) and torch.equal(first, want[2])
    assert torch.equal(first, logits[0][0])  # the reused slot starts clean


def test_p2p_combine_falls_back_to_the_all_reduce(monkeypatch):
    """Where the peer-to-peer buffers cannot be set up (GPUs without peer access), the default
    combine warns and uses the all-reduce; asked for explicitly, the failure is raised."""
    from megastep.model.fast import FastDecoder

    cfg = _cfg()
    dec = FastDecoder(cfg, synthesize_weights(cfg, SEED, include_mtp=False), max_seqs=1, max_ctx=64, device="cpu",
                      triton=False)

    def no_peer_access(*a, **k):
        raise RuntimeError("peer access is not supported between these devices")

    monkeypatch.setattr(D.PeerPairs, "__init__", no_peer_access)
    monkeypatch.setattr(D.PeerPairs, "available", staticmethod(lambda: True))
    dec.world_size = 2
    with pytest.warns(UserWarning, match="peer access is not supported.*using the all-reduce"):
        assert dec._peer_pairs(None, 4, on_cuda=True) is None
    with pytest.raises(RuntimeError, match="peer access is not supported"):
        dec._peer_pairs("p2p", 4, on_cuda=True)


# the splits over the ranks: (constructor argument, its peer buffers' class and method, module default,
# what a 3-rank refusal names, what the fallback keeps)
SPLITS = {"attn_split": ("PeerSplits", "_peer_splits", "ATTN_SPLIT", "divisible by the 3 ranks", "every head"),
          "vocab_split": ("PeerCols", "_peer_cols", "VOCAB_SPLIT", "vocabulary divisible by the 3 ranks",
                          "the whole head")}


@pytest.mark.parametrize("flag", sorted(SPLITS))
def test_split_choice_is_checked(monkeypatch, flag):
    """The attention's head split (FastDecoder(attn_split=True)) and the lm head's vocabulary split
    (vocab_split) need several ranks, CUDA devices with symmetric memory and shapes the ranks divide:
    asked for otherwise, each is refused with the reason; by default (None) it is simply not taken.
    Where its buffers cannot be set up, the default warns and keeps the work whole on every rank;
    asked for explicitly, the failure is raised."""
    from megastep.config import QuantConfig
    from megastep.model import fast
    from megastep.model.fast import FastDecoder

    cls, method, default, refused, kept = SPLITS[flag]
    # wo_b [128, 256] in 128x128 blocks: 2 K splits of 128 columns; 512 logits
    cfg = _cfg().replace(o_lora_rank=128, quantization_config=QuantConfig(weight_block_size=(128, 128)))
    w = synthesize_weights(cfg, SEED, include_mtp=False)
    with pytest.raises(ValueError, match="needs world_size > 1"):
        FastDecoder(cfg, dict(w), max_seqs=1, max_ctx=64, device="cpu", triton=False, **{flag: True})
    dec = FastDecoder(cfg, w, max_seqs=1, max_ctx=64, device="cpu", triton=False)
    assert dec.split_peer is None and dec.vocab_peer is None
    assert dec.heads == cfg.num_attention_heads and dec.head.shape[0] == cfg.vocab_size
    peers = getattr(dec, method)
    dec.world_size = 2
    with pytest.raises(ValueError, match=f"{flag} needs the Triton kernels on CUDA devices"):
        peers(True, 4, on_cuda=False)
    assert peers(None, 4, on_cuda=False) is None
    monkeypatch.setattr(getattr(D, cls), "available", staticmethod(lambda: True))
    dec.world_size = 3
    with pytest.raises(ValueError, match=refused):
        peers(True, 4, on_cuda=True)

    def no_peer_access(*a, **k):
        raise RuntimeError("peer access is not supported between these devices")

    monkeypatch.setattr(getattr(D, cls), "__init__", no_peer_access)
    monkeypatch.setattr(fast, default, True)
    dec.world_size = 2
    with pytest.warns(UserWarning, match=f"unavailable .peer access is not supported.*every rank runs {kept}"):
        assert peers(None, 4, on_cuda=True) is None
    with pytest.raises(RuntimeError, match="peer access is not supported"):
        peers(True, 4, on_cuda=True)
