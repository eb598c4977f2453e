"""The named step trace: event timing per stage, and the profiler-based kernel summary (stage
ranges, kernels attributed to the stage that launched them)."""

import pytest
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


def test_kernel_summary_ranges_on_the_profiler_timeline():
    """Each stage of each layer is a named profiler range in the exported trace (the ranges the
    kernels are attributed to); a CPU step launches no device kernels, so nothing is attributed."""
    dec = _decoder()
    dec.trace = T.StepTrace(dec.device, ranges=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(dec)
    names = {e["name"] for e in T._trace_events(prof) if e.get("cat") == "user_annotation"}
    for L in range(dec.cfg.num_hidden_layers):
        for st in ("mhc_pre", "attn_proj", "attention", "routed_experts", "shared_expert"):
            assert f"{T.RANGE_PREFIX}{st}::{L}" in names
    assert T.kernel_summary(lambda: _step(dec), dec.device) == {}


def _ev(cat, name, ts, dur=0.0, tid=1, pid=1, **args):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": pid, "args": args}


def test_kernels_attributed_to_the_innermost_range_of_their_launch():
    P = T.RANGE_PREFIX
    events = [
        _ev("user_annotation", f"{P}attention::0", 10, 20),
        _ev("user_annotation", f"{P}indexer::0", 12, 5),  # nested inside attention
        _ev("user_annotation", f"{P}attention::1", 40, 10),
        _ev("user_annotation", "not ours", 0, 100),
        _ev("cuda_driver", "cuLaunchKernelEx", 13, correlation=1),  # in indexer
        _ev("cuda_runtime", "cudaLaunchKernel", 20, correlation=2),  # in attention 0
        _ev("cuda_runtime", "cudaLaunchKernel", 45, correlation=3),  # in attention 1
        _ev("cuda_runtime", "cudaLaunchKernel", 45, tid=2, correlation=4),  # another thread: no range
        # device side: other clock, other pid/tid; matched only by correlation
        _ev("kernel", "topk", 1000, 3.0, pid=0, tid=7, correlation=1),
        _ev("kernel", "attn", 1004, 5.0, pid=0, tid=7, correlation=2),
        _ev("gpu_memset", "fill", 1010, 1.0, pid=0, tid=7, correlation=3),
        _ev("kernel", "attn", 1012, 4.0, pid=0, tid=7, correlation=3),
        _ev("kernel", "stray", 1020, 2.0, pid=0, tid=7, correlation=4),
        # no launch recorded: the range projected onto the device stream decides
        _ev("gpu_user_annotation", f"{P}head::-1", 1030, 10, pid=0, tid=7),
        _ev("kernel", "argmax", 1032, 1.5, pid=0, tid=7, correlation=99),
    ]
    ks = T.attribute_kernels(events)
    assert {k: (v["device_us"], v["kernels"]) for k, v in ks.items()} == {
        "indexer": (3.0, 1), "attention": (10.0, 3), "other": (2.0, 1), "head": (1.5, 1)}
    assert ks["attention"]["names"] == {"attn": [9.0, 2], "fill": [1.0, 1]}


def test_replay_timeline_summary_counts_overlaps_once():
    """The device timeline of a graph replay: activities in start order from the first one's
    start; busy time counts overlapping kernels (two streams, PDL's waiting kernels) once; idle
    stretches are the holes nothing covers, each after the activity that ended last."""
    events = [
        _ev("kernel", "b", 1010, 5.0, pid=0, tid=7),
        _ev("kernel", "a", 1000, 8.0, pid=0, tid=7),
        _ev("kernel", "side", 1002, 20.0, pid=0, tid=8),  # another stream, over a and b
        _ev("cuda_runtime", "cudaGraphLaunch", 990, 3.0),  # host side: not on the timeline
        _ev("gpu_memset", "fill", 1030, 2.0, pid=0, tid=7),
        _ev("kernel", "c", 1040, 10.0, pid=0, tid=7),
    ]
    acts = T.device_timeline(events)
    assert [a["name"] for a in acts] == ["a", "side", "b", "fill", "c"]
    assert [a["start_us"] for a in acts] == [0.0, 2.0, 10.0, 30.0, 40.0]
    sm = T.timeline_summary(acts)
    assert sm["activities"] == 5 and sm["span_us"] == 50.0 and sm["sum_us"] == 45.0
    assert sm["busy_us"] == 22.0 + 2.0 + 10.0  # [0, 22) + [30, 32) + [40, 50)
    assert sm["idle_us"] == 16.0
    assert sm["largest_gaps"] == [{"us": 8.0, "after": "side"}, {"us": 8.0, "after": "fill"}]
    assert T.timeline_summary([])["activities"] == 0


def test_timeline_phases_charge_the_path_and_time_the_moe_sublayer():
    """timeline_phases: the span cut at every end, each stretch charged to the activity that ends it
    (a kernel beside a longer one, here on a second stream, only for the stretch it closes); the MoE
    sublayer runs from the routing launch's end to the experts' last launch's end, the period from
    one such end to the next."""
    def act(name, start, dur):
        return {"name": name, "start_us": float(start), "dur_us": float(dur), "stream": 7}

    acts = [act("attn", 0, 10), act("route_group", 10, 5), act("moe_gate_up_lut", 12, 20),  # PDL: starts early
            act("shared_w13", 14, 10), act("moe_down_lut", 32, 8),  # layer 0: MoE 15 .. 40
            act("attn", 40, 10), act("route_group", 50, 4), act("moe_gate_up_lut", 54, 16),
            act("moe_down_lut", 70, 6)]  # layer 1: MoE 54 .. 76
    ph = T.timeline_phases(acts)
    # ends in order: attn 10, route 15, shared_w13 24, gate-up 32, down 40, attn 50, route 54, gate-up 70, down 76
    assert ph["span_by_kernel_us"] == {"moe_gate_up_lut": 8.0 + 16.0, "attn": 10.0 + 10.0,
                                       "moe_down_lut": 8.0 + 6.0, "shared_w13": 9.0, "route_group": 5.0 + 4.0}
    assert list(ph["span_by_kernel_us"])[:3] == ["moe_gate_up_lut", "attn", "moe_down_lut"]
    assert sum(ph["span_by_kernel_us"].values()) == 76.0  # the span
    assert ph["moe_phase_us"] == [25.0, 22.0] and ph["moe_phase_median_us"] == 23.5
    assert ph["layer_period_us"] == [36.0] and ph["layer_period_median_us"] == 36.0
    assert T.timeline_phases([])["moe_phase_median_us"] is None


def test_layer_anatomy_parts_of_alike_periods():
    """timeline_phases' anatomy: the periods between the experts' last ends, each activity in the
    period its end falls in, recurring names numbered in start order; alike periods (the same parts)
    grouped, the most common first, each part's median charge in end order; a period's charges add
    up to it."""
    def layer(t0, side=False):
        parts = [("attn", 0, 10), ("lin", 10, 5), ("lin", 15, 5), ("route_group", 20, 2), ("moe_down_lut", 22, 8)]
        parts += [("side", 5, 3)] if side else []  # a second stream's launch
        return [{"name": n, "start_us": t0 + s, "dur_us": float(d)} for n, s, d in parts]

    acts = sorted(layer(0.0) + layer(30.0) + layer(60.0) + layer(90.0, side=True), key=lambda a: a["start_us"])
    an = T.timeline_phases(acts)["anatomy"]
    assert an["periods"] == 3 and [k["periods"] for k in an["kinds"]] == [2, 1]
    first, second = an["kinds"]
    assert [(p["name"], p["charge_us"], p["end_us"]) for p in first["parts"]] == [
        ("attn", 10.0, 10.0), ("lin#1", 5.0, 15.0), ("lin#2", 5.0, 20.0), ("route_group", 2.0, 22.0),
        ("moe_down_lut", 8.0, 30.0)]
    # the side launch closes 90 .. 98 (start 95): attn then only 98 .. 100
    assert [(p["name"], p["charge_us"]) for p in second["parts"]] == [
        ("side", 8.0), ("attn", 2.0), ("lin#1", 5.0), ("lin#2", 5.0), ("route_group", 2.0), ("moe_down_lut", 8.0)]
    assert sum(p["charge_us"] for p in second["parts"]) == 30.0
    assert T.timeline_phases([])["anatomy"] == {"periods": 0, "kinds": []}


def test_delays_wait_at_their_stages_and_change_no_value(monkeypatch):
    """trace.DELAY_NS (a timing probe): a wait at the first entry of a stage of that name in each
    layer, every step, none elsewhere; the step's logits are the same bits with and without;
    set_delays refuses names that are not stages and negative waits, and a call without delays
    clears them."""
    from megastep.kernels import spin

    calls = []
    real = spin.spin

    def counting(out, ns):
        calls.append(ns)
        real(out, ns)

    monkeypatch.setattr(spin, "spin", counting)
    monkeypatch.setattr(T, "DELAY_NS", {})
    dec = _decoder()
    plain = _step(dec).clone()
    assert calls == []
    monkeypatch.setattr(T, "_DELAYED", set())
    T.set_delays("cpu", router=20_000, shared_expert=1_000, mhc_pre=3_000)
    assert T.DELAY_NS == {"router": 20_000, "shared_expert": 1_000, "mhc_pre": 3_000}
    assert T._DELAY_OUT[0].device.type == "cpu"
    dec2 = _decoder()
    n = dec2.cfg.num_hidden_layers
    for _ in range(2):  # every step: once a layer for each, though mhc_pre and shared_expert enter twice a layer
        calls.clear()
        delayed = _step(dec2)
        assert sorted(calls) == [1_000] * n + [3_000] * n + [20_000] * n
        assert torch.equal(delayed, plain)
    with pytest.raises(ValueError, match="not stage names: nope"):
        T.set_delays("cpu", nope=5)
    with pytest.raises(ValueError, match="at least 0 ns"):
        T.set_delays("cpu", router=-1)
    T.set_delays("cpu")
    assert T.DELAY_NS == {}


def test_spin_waits_and_refuses_a_negative_wait():
    from megastep.kernels import spin

    out = torch.zeros(1, dtype=torch.int64)
    spin.spin(out, 200_000)
    assert int(out[0]) >= 200_000  # ns the host spun (the CPU twin)
    with pytest.raises(ValueError, match="at least 0 ns"):
        spin.spin(out, -1)
