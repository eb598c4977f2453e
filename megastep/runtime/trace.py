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
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

# Stage names, in step order, as they appear in the printed table.
STAGES = (
    "embed", "mhc_pre", "attn_proj", "compressor", "indexer", "attention", "out_proj", "mhc_post",
    "router", "routed_experts", "shared_expert", "head", "sampler",
)


RANGE_PREFIX = "megastep::"  # profiler range of a stage: megastep::<stage>::<layer>


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


def _kernels_under(ev) -> list:
    """Device kernels launched by a profiler event and every op below it."""
    out = list(getattr(ev, "kernels", []))
    for child in getattr(ev, "cpu_children", []):
        out += _kernels_under(child)
    return out


def kernel_summary(step: Callable[[], object], device: torch.device) -> dict[str, dict[str, float]]:
    """Run `step()` (an eager step of a decoder whose `trace` is a StepTrace(ranges=True)) under the
    profiler -> {stage: {"device_us": summed kernel time, "kernels": launches}} over all layers."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"device_us": 0.0, "kernels": 0})
    for ev in prof.events():
        if not ev.name.startswith(RANGE_PREFIX):
            continue
        name = ev.name[len(RANGE_PREFIX):].split("::")[0]
        ks = _kernels_under(ev)
        out[name]["device_us"] += sum(k.duration for k in ks)
        out[name]["kernels"] += len(ks)
    return dict(out)


def stage(trace: StepTrace | None, name: str, layer: int = -1):
    """`with stage(trace, "attention", L):` — a no-op when no trace is attached."""
    return nullcontext() if trace is None else trace.stage(name, layer)
