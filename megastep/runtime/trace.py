"""Named step trace: per-layer, per-stage device time of an eager decode step.

The decode step marks its stages (`with trace.stage("attention", layer)`); when a `StepTrace` is
attached, each stage records a pair of CUDA events (on CPU, wall-clock time after a sync), and
`summary()` sums them by stage and by layer. With no trace attached, `stage()` is a no-op, so the
same code is captured in CUDA graphs untouched. Event pairs serialize nothing on the device, but
each stage boundary is a launch boundary, so the sum of stages is a little above the eager step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

# Stage names, in step order, as they appear in the printed table.
STAGES = (
    "embed", "mhc_pre", "attn_proj", "compressor", "indexer", "attention", "out_proj", "mhc_post",
    "router", "routed_experts", "shared_expert", "head", "sampler",
)


class StepTrace:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, int, object, object]] = []

    @contextmanager
    def stage(self, name: str, layer: int = -1):
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


def stage(trace: StepTrace | None, name: str, layer: int = -1):
    """`with stage(trace, "attention", L):` — a no-op when no trace is attached."""
    return nullcontext() if trace is None else trace.stage(name, layer)
