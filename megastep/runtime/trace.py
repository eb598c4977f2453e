"""Named step trace: per-layer, per-stage time of an eager decode step.

The decode step marks its stages (`with trace.stage("attention", layer)`); when a `StepTrace` is
attached, each stage records a pair of CUDA events (on CPU, wall-clock time after a sync), and
`summary()` sums them by stage and by layer. With no trace attached, `stage()` is a no-op, so the
same code is captured in CUDA graphs untouched.

An eager step is bound by the host's launches (tens of µs per stage of Python), so event pairs
time the host as much as the device. `kernel_summary` answers the device question instead: it runs
the step under the profiler, with each stage a named range, and sums per stage the device time of
the kernels the stage launched and their count: what the stage costs in a graph replay, less the
gaps between kernels (the graph-replay step time minus the sum of all stages is those gaps).
`replay_timeline` profiles one graph replay instead: each kernel's start and end as the graph
runs them, with PDL's overlaps and the second stream (`megastep bench --timeline`).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

# Stage names, in step order, as they appear in the printed table.
STAGES = (
    "embed", "mhc_pre", "attn_proj", "compressor", "indexer", "attention", "out_proj", "mhc_post",
    "router", "routed_experts", "expert_combine", "shared_expert", "head", "sampler",
)


RANGE_PREFIX = "megastep::"  # profiler range of a stage: megastep::<stage>::<layer>

# Timing probes only (empty in every served step): a wait of DELAY_NS[name] nanoseconds
# (kernels/spin.py) on the current stream at the first entry of a stage of that name in each layer
# (a step's stages start with "embed"), captured into the step's graphs like any launch. Set through
# `set_delays`. If the step grows by the delay once per layer the stage is in, it waited for that
# stage's start (the stage is on the critical path); if it grows less, the stage had that much
# slack. The spin also takes the PDL overlap between the launches around it, so compare two delays
# (5 and 10 us), not a delay with none (benchmarks/h200_checks.sh slack).
DELAY_NS: dict[str, int] = {}
_DELAY_OUT: list[torch.Tensor] = []  # the spin's output word, made by set_delays (never during a capture)
_DELAYED: set[tuple[str, int]] = set()  # (stage, layer) delayed since the step's "embed"


def set_delays(device: torch.device | str, **ns: int) -> None:
    """DELAY_NS = ns (stage name: nanoseconds), with the spin's output word on `device`."""
    bad = sorted(set(ns) - set(STAGES))
    if bad:
        raise ValueError(f"not stage names: {', '.join(bad)} (trace.STAGES)")
    if any(v < 0 for v in ns.values()):
        raise ValueError(f"delays are at least 0 ns, got {ns}")
    _DELAY_OUT[:] = [torch.zeros(1, dtype=torch.int64, device=device)]
    _DELAYED.clear()
    DELAY_NS.clear()
    DELAY_NS.update(ns)


class StepTrace:
    def __init__(self, device: torch.device, ranges: bool = False):
        """ranges=True also opens a profiler range per stage (for kernel_summary)."""
        self.cuda = device.type == "cuda"
        self.ranges = ranges
        self._marks: list[tuple[str, int, object, object]] = []

    @contextmanager
    def stage(self, name: str, layer: int = -1):
        if self.ranges:
            with torch.profiler.record_function(f"{RANGE_PREFIX}{name}::{layer}"):
                yield
            return
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self._marks.append((name, layer, a, b))

    def reset(self) -> None:
        self._marks.clear()

    def summary(self) -> tuple[dict[str, float], dict[int, float]]:
        """(µs by stage, µs by layer) over the recorded marks."""
        if self.cuda:
            torch.cuda.synchronize()
        by_stage: dict[str, float] = defaultdict(float)
        by_layer: dict[int, float] = defaultdict(float)
        for name, layer, a, b in self._marks:
            us = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
            by_stage[name] += us
            by_layer[layer] += us
        return dict(by_stage), dict(by_layer)


# Device activity categories in the profiler's trace (kernels and the copies/fills torch launches).
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # host-side launch calls, linked by correlation id


def attribute_kernels(events: list[dict]) -> dict[str, dict[str, float]]:
    """Profiler trace events (chrome-trace dicts) -> {stage: {"device_us", "kernels", "names"}}
    ("names": {kernel name: [µs, launches]}, to see which kernel of a stage costs what).

    A device kernel carries the correlation id of the host call that launched it (cudaLaunchKernel,
    or cuLaunchKernel(Ex) for Triton's launcher); that call lies, on the host thread's timeline,
    inside the innermost stage range open at the time. A kernel whose launch call was not
    recorded falls back to the profiler's projection of the ranges onto the device timeline
    ("gpu_user_annotation", same stream). Kernels outside every range go to "other". Host and
    device timestamps are never compared with each other."""
    ranges: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[int, tuple] = {}
    kernels: list[dict] = []
    for e in events:
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        if cat in ("user_annotation", "gpu_user_annotation") and name.startswith(RANGE_PREFIX):
            stage_name = name[len(RANGE_PREFIX):].split("::")[0]
            ranges[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e.get("dur", 0), stage_name))
        elif cat in _LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = (e.get("pid"), e.get("tid"), e["ts"])
        elif cat in _DEVICE_CATS:
            kernels.append(e)
    out: dict[str, dict] = defaultdict(lambda: {"device_us": 0.0, "kernels": 0, "names": {}})
    for k in kernels:
        launch = launches.get((k.get("args") or {}).get("correlation"))
        pid, tid, ts = launch if launch is not None else (k.get("pid"), k.get("tid"), k["ts"])
        inner = [r for r in ranges.get((pid, tid), ()) if r[0] <= ts <= r[1]]
        where = min(inner, key=lambda r: r[1] - r[0])[2] if inner else "other"
        us = float(k.get("dur", 0.0))
        out[where]["device_us"] += us
        out[where]["kernels"] += 1
        by_name = out[where]["names"].setdefault(k.get("name", "?"), [0.0, 0])
        by_name[0] += us
        by_name[1] += 1
    return dict(out)


def kernel_summary(step: Callable[[], object], device: torch.device) -> dict[str, dict]:
    """Run `step()` (an eager step of a decoder whose `trace` is a StepTrace(ranges=True)) under the
    profiler -> {stage: {"device_us": summed kernel time, "kernels": launches}} over all layers
    (stages that launched nothing on the device are absent; "other": launched outside a stage)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return attribute_kernels(_trace_events(prof))


def device_timeline(events: list[dict]) -> list[dict]:
    """Profiler trace events -> the device activities (kernels, copies, fills) in start order:
    {"name", "start_us" (from the first one's start), "dur_us", "stream"}."""
    acts = sorted((e for e in events if e.get("cat", "") in _DEVICE_CATS and "ts" in e), key=lambda e: e["ts"])
    if not acts:
        return []
    t0 = acts[0]["ts"]
    return [{"name": e.get("name", "?"), "start_us": float(e["ts"] - t0), "dur_us": float(e.get("dur", 0.0)),
             "stream": (e.get("args") or {}).get("stream", e.get("tid"))} for e in acts]


def timeline_summary(acts: list[dict], gaps: int = 8) -> dict:
    """What a device timeline (`device_timeline`) spent: its span, the summed activity time, the
    time covered by at least one activity ("busy"; overlapping activities counted once: other
    streams, PDL's early-placed kernels waiting) and the rest ("idle"), and the `gaps` largest idle
    stretches with the activity before each."""
    if not acts:
        return {"activities": 0, "span_us": 0.0, "sum_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "largest_gaps": []}
    span = max(a["start_us"] + a["dur_us"] for a in acts) - acts[0]["start_us"]
    busy, end, holes = 0.0, acts[0]["start_us"], []
    last = acts[0]["name"]
    for a in acts:  # in start order: a stretch before `a` that nothing covers is idle
        s, e = a["start_us"], a["start_us"] + a["dur_us"]
        if s > end:
            holes.append((s - end, last))
        busy += max(0.0, e - max(s, end))
        if e >= end:
            end, last = e, a["name"]
    holes.sort(key=lambda h: -h[0])
    return {"activities": len(acts), "span_us": span, "sum_us": sum(a["dur_us"] for a in acts), "busy_us": busy,
            "idle_us": span - busy, "largest_gaps": [{"us": us, "after": name} for us, name in holes[:gaps]]}


def timeline_phases(acts: list[dict]) -> dict:
    """Where a device timeline's span goes, across streams: the span, cut at every activity's end,
    each stretch charged to the activity that ends it, summed by name ("span_by_kernel_us", largest
    first; the charges add up to the span). A kernel running beside a longer one is charged only for the
    stretch it closes, and a PDL launch placed early only from the previous end on. Per MoE layer:
    the MoE sublayer's weight phase, from the end of its routing launch (a name with "route") to
    the end of its experts' last launch (a name with "moe" and "down"), and the period from one
    such end to the next (all values and medians, us; the first layer has no period). "anatomy":
    `layer_anatomy` of those periods."""
    by_kernel: dict[str, float] = {}
    charge: dict[int, float] = {}  # id(activity) -> the stretch it closes
    frontier = acts[0]["start_us"] if acts else 0.0
    for a in sorted(acts, key=lambda a: a["start_us"] + a["dur_us"]):
        e = a["start_us"] + a["dur_us"]
        charge[id(a)] = max(0.0, e - frontier)
        by_kernel[a["name"]] = by_kernel.get(a["name"], 0.0) + charge[id(a)]
        frontier = max(frontier, e)
    route_end, downs, moe = None, [], []
    for a in acts:  # in start order: a layer's routing launch comes before its experts' last one
        e = a["start_us"] + a["dur_us"]
        if "route" in a["name"]:
            route_end = e
        elif "moe" in a["name"] and "down" in a["name"] and route_end is not None:
            moe.append(e - route_end)
            downs.append(e)
            route_end = None
    period = [b - a for a, b in zip(downs, downs[1:])]

    def median(v):
        return statistics.median(v) if v else None

    return {"span_by_kernel_us": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])), "moe_phase_us": moe,
            "moe_phase_median_us": median(moe), "layer_period_us": period, "layer_period_median_us": median(period),
            "anatomy": layer_anatomy(acts, downs, charge)}


def layer_anatomy(acts: list[dict], bounds: list[float], charge: dict[int, float], kinds: int = 2) -> dict:
    """What a layer's period is made of (`timeline_phases` passes its layers' bounds, the experts'
    last ends, and each activity's charge: the stretch it closes). The activities that end in a
    period are its parts, each named by its kernel and, where the name recurs, its place among them
    in start order ("_linear_fp8_kernel#3": the period's third FP8 linear to start). Periods with the
    same parts are alike (attention kinds differ in launches, and a side stream's last launch may
    end in the next period). For the `kinds` most common: how many periods, and per part in the
    order of its median end within the period, the median charge and duration (us). The charges of
    a period add up to it."""
    periods: list[list[dict]] = [[] for _ in bounds[1:]]
    for a in acts:
        i = bisect.bisect_left(bounds, a["start_us"] + a["dur_us"])  # (bounds[i-1], bounds[i]] holds the end
        if 1 <= i < len(bounds):
            periods[i - 1].append(a)
    alike: dict[tuple[str, ...], list[tuple[float, list[dict]]]] = {}
    for lo, parts in zip(bounds, periods):
        parts.sort(key=lambda a: a["start_us"])
        count, seen, labels = Counter(a["name"] for a in parts), Counter(), []
        for a in parts:
            seen[a["name"]] += 1
            labels.append(a["name"] if count[a["name"]] == 1 else f"{a['name']}#{seen[a['name']]}")
        alike.setdefault(tuple(labels), []).append((lo, parts))
    out = []
    for labels, layers in sorted(alike.items(), key=lambda kv: -len(kv[1]))[:kinds]:
        parts = [{"name": name,
                  "end_us": statistics.median(ps[j]["start_us"] + ps[j]["dur_us"] - lo for lo, ps in layers),
                  "charge_us": statistics.median(charge[id(ps[j])] for _, ps in layers),
                  "dur_us": statistics.median(ps[j]["dur_us"] for _, ps in layers)} for j, name in enumerate(labels)]
        out.append({"periods": len(layers), "parts": sorted(parts, key=lambda p: p["end_us"])})
    return {"periods": len(periods), "kinds": out}


def replay_timeline(replay: Callable[[], object], device: torch.device) -> list[dict]:
    """Run `replay()` (one CUDA-graph replay of a step) under the profiler -> its device timeline
    (`device_timeline`): where the graph's kernels start and end, PDL and the second stream
    included, which the eager `kernel_summary` cannot show."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize(device)
    return device_timeline(_trace_events(prof))


def _trace_events(prof) -> list[dict]:
    """The profiler's chrome-trace events (its one export that keeps correlation ids and ranges)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def stage(trace: StepTrace | None, name: str, layer: int = -1):
    """`with stage(trace, "attention", L):` — a no-op when no trace is attached (and no DELAY_NS)."""
    if DELAY_NS:
        if name == "embed":
            _DELAYED.clear()
        if DELAY_NS.get(name) and (name, layer) not in _DELAYED:
            from megastep.kernels import spin

            _DELAYED.add((name, layer))
            spin.spin(_DELAY_OUT[0], DELAY_NS[name])
    return nullcontext() if trace is None else trace.stage(name, layer)
