"""Expert parallelism on two GPUs (skipped otherwise): the fast decoder with its routed experts
split over the ranks gives the 1-GPU decoder's logits bit for bit, eagerly and replayed from CUDA
graphs, at batch 1, 4 and 8, with either combine: the peer-to-peer gather (arrival flags and NVLink
loads inside the graph, kernels/pair_combine.py) and the integer all-reduce through NCCL; and with the
one-GPU step's MoE order at few rows (CUDA routing, the shared expert forked after the router) at
every batch, which the ranks take by default at 1 and 7-16 rows (FastDecoder.MOE_PLAN_EP: batch 8 runs
it with PDL, on up to 16 rows with the p2p combine); with programmatic dependent launch on the
ranks and off; with the attention's heads split over the ranks as well (tensor parallelism: wo_b's
split-K partials gathered over NVLink, kernels/split_combine.py) and the lm head's vocabulary; and with the one-GPU side streams
(the indexer and the mHC Sinkhorn beside) on the ranks."""

import pytest
import torch

from megastep.runtime import distributed as D

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA devices")]

SEED = 5
STEPS = 12


def _cfg():
    from megastep.checkpoint.synthetic import preset

    return preset("small", layers=3)


def _greedy_rows(dec, runner, batch: int, steps: int):
    """`batch` sequences (slots 0..batch-1) fed distinct prompts of 4 tokens, then greedy; the
    logits of every step [steps+4, batch, V] through `runner` (graph) and the same through eager steps."""
    dev = dec.device
    out = {}
    for mode in ("graph", "eager"):
        for s in range(batch):
            dec.pools.reset(s)
        prompt = torch.randint(0, dec.cfg.vocab_size, (4, batch), generator=torch.Generator().manual_seed(7))
        slots = torch.arange(batch, device=dev)
        tok, rows = prompt[0].to(dev), []
        for t in range(4 + steps):
            pos = torch.full((batch,), t, dtype=torch.long, device=dev)
            if mode == "graph":
                lg, nt = runner.run(tok, pos, slots)
            else:
                lg = dec.step(tok, pos, slots)
                nt = lg.argmax(-1)
            rows.append(lg.clone())
            tok = prompt[t + 1].to(dev) if t + 1 < 4 else nt
        out[mode] = torch.stack(rows).cpu()
    return out


def _run(dec, batches):
    from megastep.runtime.step import StepRunner

    runner = StepRunner(dec.step, dec.device, dec.pools.dummy_slot, buckets=batches)
    return {b: _greedy_rows(dec, runner, b, STEPS) for b in batches}


def _ep_rank(r: D.Rank, batches, ep_combine, plan):
    from megastep.model import fast
    from megastep.model.fast import FastDecoder

    plan = dict(plan)
    fast.BESIDE_ON_RANKS = plan.pop("beside_on_ranks", False)
    cfg = _cfg()
    w = D.synthesize_rank_weights(cfg, SEED, r.rank, r.world_size, device=r.device)
    dec = FastDecoder(cfg, w, max_seqs=max(batches), max_ctx=64, device=r.device,
                      rank=r.rank, world_size=r.world_size, ep_combine=ep_combine, **plan)
    assert (dec.peer is not None) == (ep_combine == "p2p")
    assert (dec.split_peer is not None) == plan.get("attn_split", fast.ATTN_SPLIT)
    assert dec.heads == (8 if dec.split_peer else 16)
    assert (dec.vocab_peer is not None) == bool(plan.get("vocab_split"))
    return _run(dec, batches)


BATCHES = (1, 4, 8)  # 8: the ranks' 7-16 row plan (MOE_PLAN_EP) and PDL there (PDL_MAX_ROWS_EP)


@pytest.fixture(scope="module")
def one_gpu():
    from megastep.checkpoint.synthetic import synthesize_weights
    from megastep.model.fast import FastDecoder

    cfg = _cfg()
    one = FastDecoder(cfg, synthesize_weights(cfg, SEED, device="cuda:0", include_mtp=False), max_seqs=max(BATCHES),
                      max_ctx=64, device="cuda:0")
    want = _run(one, BATCHES)
    del one
    torch.cuda.empty_cache()
    return want


# FastDecoder's MoE order on the ranks: their default (by rows), and the one-GPU plan's at 1-4 rows for every row
# count; programmatic dependent launch off ("no_pdl") and on ("pdl"): by default it is on up to PDL_MAX_ROWS_EP
# rows with the p2p combine (so "default" runs it there) and off with the all-reduce one
# "split": the attention's heads split over the ranks (attn_split, the default since the twenty-sixth
# measurement; the small preset's 16 heads: 8 per rank in the full launch's 16-head programs) and the lm head's
# vocabulary (vocab_split); "no_split": every head on every rank; "beside": the one-GPU side streams on the
# ranks too (BESIDE_ON_RANKS)
PLANS = {"default": {}, "no_split": {"attn_split": False}, "cuda_late": {"router": "cuda", "shared_after_router": True},
         "no_pdl": {"pdl": False},
         "pdl": {"pdl": True}, "split": {"attn_split": True, "vocab_split": True},
         "split_no_pdl": {"attn_split": True, "vocab_split": True, "pdl": False},
         "beside": {"beside_on_ranks": True}}


@pytest.mark.parametrize("ep_combine,plan", [("p2p", "default"), ("p2p", "no_split"), ("allreduce", "default"),
                                             ("p2p", "cuda_late"),
                                             ("p2p", "no_pdl"), ("allreduce", "pdl"), ("p2p", "split"),
                                             ("allreduce", "split"), ("p2p", "split_no_pdl"), ("p2p", "beside")])
def test_expert_parallel_matches_one_gpu(one_gpu, ep_combine, plan):
    want = one_gpu
    outs = D.launch(_ep_rank, 2, (BATCHES, ep_combine, PLANS[plan]), backend="nccl", gpus=[0, 1], timeout_s=600)
    for b in BATCHES:
        assert torch.equal(want[b]["graph"], want[b]["eager"]), f"batch {b}: 1 GPU graph != eager"
        for rank, o in enumerate(outs):
            for mode in ("graph", "eager"):
                assert torch.equal(o[b][mode], want[b][mode]), f"rank {rank}, batch {b}, {mode}: logits differ from 1 GPU"
