"""The model as the scheduler sees it: sequences that take tokens and give back next-token logits.

The scheduler (and through it the server) only ever talks to an `Engine`:

    seq = engine.new_sequence()                  # takes per-sequence state
    logits = engine.forward_batch([(seq, ids)])   # one [vocab] fp32 row per entry: logits after ids[-1]
    engine.free(seq)                              # gives the state back

`forward_batch` gets every row of one scheduler step at once (decode rows of one token first, then at
most one prefill chunk), so a GPU engine can run them as one batched step; the CPU reference engine
runs them one after the other. Row results must not depend on which other rows share the step: that
is what makes a request's output the same alone and under load.

Three engines live here:
  * `ReferenceEngine` wraps the plain-PyTorch reference decode (`megastep.model.reference`).
  * `FastEngine` runs the batched fast path (`megastep.model.fast`) through per-bucket CUDA graphs.
  * `FakeEngine` is a tiny deterministic stand-in (logits are a hash of the sequence so far) that
    costs microseconds per token; scheduler unit tests and the leak test run on it.
"""

from __future__ import annotations

import functools

import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence as Seq

import torch

from megastep.errors import AUTO, UserError


@dataclass
class SequenceState:
    """An engine's handle for one sequence: `pos` tokens consumed so far, `data` engine-private."""

    sid: int
    pos: int = 0
    data: Any = None
    freed: bool = False


class Engine(Protocol):
    """What the scheduler needs from a model. See the module docstring."""

    name: str
    vocab_size: int
    max_seq_len: int                 # longest sequence (prompt + generated) one state can hold
    eos_token_ids: tuple[int, ...]
    state_bytes_per_token: float     # state that grows with context, per token
    state_bytes_fixed: int           # state that does not grow (window rings, compressor buffers)

    def new_sequence(self) -> SequenceState: ...

    def forward_batch(self, rows: Seq[tuple[SequenceState, list[int]]]) -> list[torch.Tensor]: ...

    def free(self, seq: SequenceState) -> None: ...

    def default_capacity(self, max_seqs: int) -> int: ...

    @property
    def live_sequences(self) -> int: ...


class _EngineBase:
    """Sequence bookkeeping shared by the engines: ids, the live count, double-free detection."""

    def __init__(self) -> None:
        self._next_sid = 0
        self._live: dict[int, SequenceState] = {}
        self._lock = threading.Lock()

    def _register(self, data: Any) -> SequenceState:
        with self._lock:
            seq = SequenceState(sid=self._next_sid, data=data)
            self._next_sid += 1
            self._live[seq.sid] = seq
        return seq

    def free(self, seq: SequenceState) -> None:
        with self._lock:
            if seq.freed or seq.sid not in self._live:
                raise RuntimeError(f"sequence {seq.sid} freed twice")
            seq.freed = True
            seq.data = None
            del self._live[seq.sid]

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    def default_capacity(self, max_seqs: int) -> int:
        # CPU: no device memory to size from; give every slot up to 4096 tokens.
        return max_seqs * min(self.max_seq_len, 4096)  # type: ignore[attr-defined]


class ReferenceEngine(_EngineBase):
    """The plain-PyTorch reference decode behind the `Engine` protocol (CPU, one row at a time)."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", quant_sim: bool = True) -> None:
        super().__init__()
        from megastep.checkpoint.loader import load_checkpoint
        from megastep.model.reference import ReferenceModel

        self.device = torch.device(device)
        cfg, weights = load_checkpoint(model_dir, device=self.device)
        self.cfg = cfg
        self.model = ReferenceModel(cfg, weights, quant_sim=quant_sim)
        del weights
        self.name = Path(model_dir).name
        self.vocab_size = int(cfg.vocab_size)
        self.max_seq_len = int(cfg.max_position_embeddings)
        self.eos_token_ids = (int(cfg.eos_token_id),)
        self.state_bytes_per_token = float(cfg.state_bytes_per_token())
        self.state_bytes_fixed = int(cfg.state_bytes_fixed())

    def new_sequence(self) -> SequenceState:
        return self._register(self.model.new_state())

    def default_capacity(self, max_seqs: int) -> int:
        """On a GPU: the free device memory after weights (90% of it, less every slot's fixed
        state), in tokens of growing state. On the CPU: up to 4096 tokens per slot."""
        if self.device.type != "cuda":
            return super().default_capacity(max_seqs)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = 0.9 * free - max_seqs * self.state_bytes_fixed
        tokens = int(budget / max(self.state_bytes_per_token, 1.0))
        return max(0, min(tokens, max_seqs * self.max_seq_len))

    @torch.inference_mode()
    def forward_batch(self, rows: Seq[tuple[SequenceState, list[int]]]) -> list[torch.Tensor]:
        out = []
        for seq, ids in rows:
            logits = self.model.forward(seq.data, list(ids))
            seq.pos += len(ids)
            out.append(logits[-1].float().cpu())   # the sampler runs on the host
        return out


class FastEngine(_EngineBase):
    """The fast decode step behind the `Engine` protocol: one state-pool slot per sequence, every
    decode row of a scheduler step in one graph replay. Prefill chunks advance up to `max_block`
    tokens of each sequence per replay (a multi-token block, causal within the block), through a
    second set of graphs whose step runs the compressors once per block position.

    Every kernel's configuration depends on weight shapes only, so a row's bits do not depend on
    the other rows of its step (measured on an H200: `benchmarks/fast_engine_smoke.py`)."""

    def __init__(self, model_dir: str | Path, *, device: str = "cuda", max_seqs: int = 8, max_ctx: int = 4096,
                 max_block: int = 1, hbm_budget_gb: float | None = None, routing_profile: str | Path | None = None,
                 cold_path: str = "gpu", rank: int = 0, world_size: int = 1) -> None:
        """max_block: prefill tokens of a sequence per replay (1: one by one; 16 cuts a prompt's
        replays 16-fold; checked on the CPU, not yet run on a GPU, hence the default 1).
        hbm_budget_gb: keep only that many GB of weights in device memory ("auto": what the
        device has free, less the state and a margin: runtime/experts.auto_budget_bytes); the
        routed experts the placement (runtime/experts.py, from `routing_profile` or uniform routing) finds
        coldest stay in page-locked host memory, handled by `cold_path` (FastDecoder). The
        checkpoint is then read tensor by tensor as each layer is built, so a model larger than
        the device loads.
        rank / world_size: expert parallelism (runtime/distributed.py; the process group is
        initialized): this process loads and runs 1/world_size of the routed experts. Rank 0 is
        the engine the scheduler drives; it sends every slot reset and step to the other ranks
        (`StepChannel`), which run `follow()` until rank 0's `close()`."""
        super().__init__()
        from megastep.checkpoint.loader import load_checkpoint
        from megastep.model.fast import FastDecoder
        from megastep.runtime.step import DEFAULT_BUCKETS, StepRunner

        self.device = torch.device(device)
        placement = None
        if world_size > 1:
            from megastep.runtime.distributed import load_rank_checkpoint

            if hbm_budget_gb is not None or routing_profile is not None:
                raise UserError("several GPUs hold every routed expert in device memory: drop --hbm-budget")
            cfg, weights = load_rank_checkpoint(model_dir, rank, world_size, device=self.device)
        elif hbm_budget_gb is None:
            if routing_profile is not None:
                raise UserError("a routing profile places experts for an HBM budget: give --hbm-budget too")
            cfg, weights = load_checkpoint(model_dir, device=self.device)
        else:
            from megastep.checkpoint.loader import open_checkpoint
            from megastep.routing import load_profile

            if hbm_budget_gb == AUTO and self.device.type != "cuda":
                raise UserError("--hbm-budget auto sizes the budget from a CUDA device's free memory: give GB")
            cfg, weights = open_checkpoint(model_dir, device=self.device)
            profile = load_profile(routing_profile, cfg) if routing_profile is not None else None
        self.cfg = cfg
        max_ctx = min(max_ctx, int(cfg.max_position_embeddings))
        self.block = max(1, min(int(max_block), int(cfg.sliding_window)))
        if hbm_budget_gb is not None:  # (one GPU: the ranks refused a budget above)
            from megastep.runtime.experts import GB, auto_budget_bytes, plan_placement

            budget = (auto_budget_bytes(cfg, self.device, max_seqs=max_seqs, max_ctx=max_ctx, max_block=self.block)
                      if hbm_budget_gb == AUTO else int(hbm_budget_gb * GB))
            placement = plan_placement(cfg, profile, budget)
        self.placement = placement
        try:
            self.decoder = FastDecoder(cfg, weights, max_seqs=max_seqs, max_ctx=max_ctx, device=self.device,
                                       consume=True, max_block=self.block, placement=placement, cold_path=cold_path,
                                       rank=rank, world_size=world_size)
        except ValueError as e:  # a cold path this device cannot run, and the like
            raise UserError(str(e)) from None
        del weights
        dummy = self.decoder.pools.dummy_slot
        buckets = tuple(b for b in DEFAULT_BUCKETS if b < max_seqs) + (max_seqs,)
        self.runner = StepRunner(self.decoder.step, self.device, dummy, buckets=buckets)
        self.block_runner = None
        if self.block > 1:  # prefill: up to `block` rows per sequence, so up to max_seqs * block rows
            most = max_seqs * self.block
            sizes = tuple(1 << i for i in range(most.bit_length()) if (1 << i) < most) + (most,)
            self.block_runner = StepRunner(functools.partial(self.decoder.step, block=self.block), self.device, dummy,
                                           buckets=sizes)
        self.name = Path(model_dir).name
        self.vocab_size = int(cfg.vocab_size)
        self.max_seq_len = max_ctx
        self.eos_token_ids = (int(cfg.eos_token_id),)
        self.state_bytes_per_token = float(cfg.state_bytes_per_token())
        self.state_bytes_fixed = int(cfg.state_bytes_fixed())
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self.rank = rank
        self.channel = None
        if world_size > 1:
            from megastep.runtime.distributed import StepChannel

            self.channel = StepChannel(max_seqs * self.block)

    def new_sequence(self) -> SequenceState:
        if not self._free_slots:
            raise RuntimeError("no free state slot (the scheduler admits at most max_seqs sequences)")
        slot = self._free_slots.pop()
        if self.channel is not None:
            self.channel.reset(slot)
        self.decoder.pools.reset(slot)
        return self._register(slot)

    def free(self, seq: SequenceState) -> None:
        slot = seq.data
        super().free(seq)
        self._free_slots.append(slot)

    def default_capacity(self, max_seqs: int) -> int:
        return max_seqs * self.max_seq_len  # the pools are allocated up front for max_ctx each

    def _step(self, rows: list[tuple[int, int, int]], runner) -> torch.Tensor:
        dev = self.device
        toks, pos, slots = (torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*rows))
        logits, _ = runner.run(toks, pos, slots)
        return logits

    def _run(self, rows: list[tuple[int, int, int]], runner) -> torch.Tensor:
        if self.channel is not None:  # the other ranks run the same step
            self.channel.run(0 if runner is self.runner else 1, rows)
        out = self._step(rows, runner).float().cpu()
        self.decoder.check_waits()  # (a device-side wait that gave up left wrong values)
        return out

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run rank 0's slot resets and steps, in its order, until it closes."""
        if self.channel is None or self.rank == 0:
            raise RuntimeError("follow() is for the ranks > 0 of an expert-parallel engine")
        ch = self.channel
        while True:
            kind, arg, rows = ch.receive()
            if kind == ch.STOP:
                return
            if kind == ch.RESET:
                self.decoder.pools.reset(arg)
            elif kind == ch.RUN:
                self._step(rows, self.runner if arg == 0 else self.block_runner)
            else:
                raise RuntimeError(f"unknown step command {kind}")

    def close(self) -> None:
        """Rank 0 of an expert-parallel engine: let the other ranks' `follow()` return."""
        if self.channel is not None and self.rank == 0:
            self.channel.stop()
            self.channel = None

    @torch.inference_mode()
    def forward_batch(self, rows: Seq[tuple[SequenceState, list[int]]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(rows)
        # every sequence's next tokens share one replay: one each when every sequence has one
        # left (decode), else up to `block` each (a prefill chunk advances as a block)
        todo = [(i, seq, list(ids)) for i, (seq, ids) in enumerate(rows)]
        while todo:
            multi = self.block_runner is not None and any(len(ids) > 1 for _, _, ids in todo)
            k = self.block if multi else 1
            batch, taken = [], []  # taken: (tokens of the sequence in this step, its last row)
            for _, seq, ids in todo:
                n = min(k, len(ids))
                batch += [(ids[j], seq.pos + j, seq.data) for j in range(n)]
                taken.append((n, len(batch) - 1))
            logits = self._run(batch, self.block_runner if multi else self.runner)
            nxt = []
            for (i, seq, ids), (n, j) in zip(todo, taken):
                seq.pos += n
                if n == len(ids):
                    out[i] = logits[j]
                else:
                    nxt.append((i, seq, ids[n:]))
            todo = nxt
        return out  # type: ignore[return-value]


class FakeEngine(_EngineBase):
    """Deterministic toy model: the logits after a sequence are a pure function of its tokens.

    The next-token distribution is a seeded random vector keyed by a rolling hash of every token
    consumed so far, so chunked and unchunked prefill agree exactly, rows are independent of each
    other, and greedy output is reproducible. `eos_every` makes EOS the argmax whenever the hash
    says so (about one in `eos_every` positions), to exercise early stops; `step_delay_s` makes a
    step slow enough to observe queueing.
    """

    def __init__(self, vocab_size: int = 512, max_seq_len: int = 4096, *, eos_id: int = 1,
                 eos_every: int = 0, step_delay_s: float = 0.0, name: str = "fake") -> None:
        super().__init__()
        self.name = name
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = (eos_id,)
        self.eos_every = eos_every
        self.step_delay_s = step_delay_s
        self.state_bytes_per_token = 64.0
        self.state_bytes_fixed = 1024
        self.steps = 0
        self.rows_seen: list[list[int]] = []   # per step: how many tokens each row carried

    def new_sequence(self) -> SequenceState:
        return self._register(b"")

    def _logits(self, key: bytes) -> torch.Tensor:
        digest = hashlib.blake2b(key, digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 62) - 1))
        logits = torch.randn(self.vocab_size, generator=g) * 3.0
        eos = self.eos_token_ids[0]
        if self.eos_every and digest[0] % self.eos_every == 0:
            logits[eos] = logits.max() + 1.0
        else:
            logits[eos] = logits.min() - 1.0
        return logits

    def forward_batch(self, rows: Seq[tuple[SequenceState, list[int]]]) -> list[torch.Tensor]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        self.rows_seen.append([len(ids) for _, ids in rows])
        out = []
        for seq, ids in rows:
            if seq.freed:
                raise RuntimeError(f"forward on freed sequence {seq.sid}")
            if seq.pos + len(ids) > self.max_seq_len:
                raise RuntimeError(f"sequence {seq.sid} past max_seq_len")
            key = seq.data
            for t in ids:
                key = hashlib.blake2b(key + int(t).to_bytes(4, "little"), digest_size=16).digest()
            seq.data = key
            seq.pos += len(ids)
            out.append(self._logits(key))
        return out
