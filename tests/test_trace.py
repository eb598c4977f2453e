"""The named step trace: event timing per stage, and the profiler-based kernel summary (stage
ranges, kernels attributed to the stage that launched them)."""

from types import SimpleNamespace

import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.model.fast import FastDecoder
from megastep.runtime import trace as T


def _decoder():
    cfg = preset("tiny").replace(vocab_size=256)
    return FastDecoder(cfg, synthesize_weights(cfg, seed=1, include_mtp=False), max_seqs=2, max_ctx=32, device="cpu")


def _step(dec):
    return dec.step(torch.tensor([3, 4]), torch.tensor([0, 0]), torch.tensor([0, 1]))


def test_event_trace_names_every_stage_of_every_layer():
    dec = _decoder()
    dec.trace = T.StepTrace(dec.device)
    _step(dec)
    by_stage, by_layer = dec.trace.summary()
    for name in ("embed", "mhc_pre", "attn_proj", "indexer", "compressor", "attention", "out_proj", "mhc_post",
                 "router", "routed_experts", "shared_expert", "head"):
        assert by_stage[name] > 0, name
    assert set(by_layer) == {-1} | set(range(dec.cfg.num_hidden_layers))


def test_kernel_summary_ranges_and_attribution():
    dec = _decoder()
    dec.trace = T.StepTrace(dec.device, ranges=True)
    ks = T.kernel_summary(lambda: _step(dec), dec.device)
    assert {"mhc_pre", "attn_proj", "attention", "routed_experts", "shared_expert", "head"} <= set(ks)
    assert all(v["kernels"] == 0 and v["device_us"] == 0 for v in ks.values())  # no device kernels on a CPU
    # kernels below a range are found at any depth, each once
    k = lambda us: SimpleNamespace(duration=us)  # noqa: E731
    leaf = SimpleNamespace(kernels=[k(2.0)], cpu_children=[])
    mid = SimpleNamespace(kernels=[k(3.0)], cpu_children=[leaf])
    top = SimpleNamespace(kernels=[], cpu_children=[mid, SimpleNamespace(kernels=[k(5.0)], cpu_children=[])])
    assert sorted(x.duration for x in T._kernels_under(top)) == [2.0, 3.0, 5.0]
