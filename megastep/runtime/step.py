"""Runs a decode step eagerly or through one CUDA graph per batch bucket.

The step function sees only static buffers: token ids, positions and state-slot ids of the rows
[bucket] in, fp32 logits and next tokens [bucket] out: greedy, or (sampling=True) drawn on the
device from each row's temperature / top-k / top-p / seed (runtime/sampling.py). A batch of B rows
is padded to the smallest bucket >= B with rows that point at the dummy slot; the padded rows'
outputs are dropped. Nothing inside a step synchronizes with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megastep.kernels.argmax import argmax_rows
from megastep.runtime.sampling import sample

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Bucket:
    def __init__(self, size: int, device: torch.device, dummy_slot: int):
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.pos = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), dummy_slot, dtype=torch.long, device=device)
        # sampling parameters per row (used when the runner samples; padding rows stay greedy)
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(size, dtype=torch.long, device=device)
        self.top_p = torch.ones(size, dtype=torch.float32, device=device)
        self.seed = torch.zeros(size, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.next_tokens: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class StepRunner:
    """`run(tokens, pos, slots)` -> (logits [B, V], greedy tokens [B]) on the device."""

    def __init__(self, step: StepFn, device: torch.device, dummy_slot: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None, sampling: bool = False):
        self.step = step
        self.sampling = sampling
        self.device = torch.device(device)
        self.dummy_slot = dummy_slot
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = {b: _Bucket(b, self.device, dummy_slot) for b in sorted(buckets)}

    def bucket_for(self, n: int) -> _Bucket:
        for size, b in self.buckets.items():
            if size >= n:
                return b
        raise ValueError(f"{n} rows exceed the largest bucket ({max(self.buckets)})")

    def _body(self, b: _Bucket) -> None:
        b.logits = self.step(b.tokens, b.pos, b.slots)
        if self.sampling:
            b.next_tokens = sample(b.logits, b.temperature, b.top_k, b.top_p, b.seed, b.pos)
        elif b.logits.is_cuda and b.logits.dtype == torch.float32:
            # torch.argmax's bits in one launch: -35 to -55 us per step on an H200 (docs/PERFORMANCE.md,
            # sixteenth measurement); the CPU keeps torch's
            b.next_tokens = argmax_rows(b.logits)
        else:
            b.next_tokens = torch.argmax(b.logits, dim=-1)

    def capture(self, b: _Bucket) -> None:
        """Record the bucket's graph. The warm-up runs write only to the dummy slot (every row of
        the static buffers points there until real rows are copied in)."""
        saved = (b.tokens.clone(), b.pos.clone(), b.slots.clone())
        b.tokens.zero_(), b.pos.zero_(), b.slots.fill_(self.dummy_slot)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile Triton kernels, settle the allocator
                self._body(b)
        torch.cuda.current_stream().wait_stream(s)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph):
            self._body(b)
        for dst, src in zip((b.tokens, b.pos, b.slots), saved):
            dst.copy_(src)

    def load(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
             sampling: dict[str, torch.Tensor] | None = None) -> _Bucket:
        """Copy the rows into the bucket's static buffers. sampling: per-row tensors named
        temperature, top_k, top_p, seed (a runner built with sampling=True; absent rows: greedy)."""
        n = tokens.shape[0]
        b = self.bucket_for(n)
        b.tokens[:n].copy_(tokens, non_blocking=True)
        b.pos[:n].copy_(pos, non_blocking=True)
        b.slots[:n].copy_(slots, non_blocking=True)
        if n < b.size:
            b.tokens[n:].zero_(), b.pos[n:].zero_(), b.slots[n:].fill_(self.dummy_slot)
        if sampling is not None and not self.sampling:
            raise ValueError("this runner was built without sampling")
        if self.sampling:  # rows without parameters (and padding rows) decode greedily
            b.temperature.zero_(), b.top_k.zero_(), b.top_p.fill_(1.0), b.seed.zero_()
            for name, v in (sampling or {}).items():
                getattr(b, name)[:n].copy_(v, non_blocking=True)
        return b

    def replay(self, b: _Bucket) -> None:
        if self.use_graphs:
            if b.graph is None:
                self.capture(b)
            b.graph.replay()
        else:
            self._body(b)

    def run(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
            sampling: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[0]
        b = self.load(tokens, pos, slots, sampling)
        self.replay(b)
        return b.logits[:n], b.next_tokens[:n]
