"""Admission, continuous batching, chunked prefill and per-request sampling over an `Engine`.

One scheduler thread owns the running set and calls the engine; the server's event loop only
submits and cancels requests (both thread-safe) and hears back through each request's sink.

A step, from the top:
  1. drop cancelled requests (client went away) and free their state;
  2. admit waiting requests in arrival order while a sequence slot and enough pool tokens are free
     (a request reserves prompt + max_tokens tokens up front, so a running request never runs out
     of state and nothing is ever preempted; the head of the queue blocks the rest, so a large
     request is not starved by small ones);
  3. build the batch: one decode row (the last sampled token) per running request that finished
     its prompt, then at most one prefill chunk: the next `chunk` prompt tokens of the oldest
     request still prefilling. Chunk boundaries depend only on the request itself (multiples of
     `chunk` from position 0), never on what else is running, so a request's numerics, and hence
     its greedy output, are the same alone and under load;
  4. run the engine, sample each row that produced a next token with that request's own generator,
     apply stop conditions (EOS, max_tokens, the sink's stop strings) and free finished requests.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megastep.runtime.engine import Engine, SequenceState

log = logging.getLogger("megastep.scheduler")

STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class QueueFull(Exception):
    """More requests are waiting than the queue limit allows; retry later."""


class RequestTooLarge(Exception):
    """The request can never fit in one sequence of the state pool."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy (argmax, lowest index on ties)
    top_p: float = 1.0
    top_k: int = 0                # 0 = no top-k cut
    max_tokens: int = 16
    seed: int | None = None       # None: a fresh random seed per request
    ignore_eos: bool = False


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries, ordered by value descending then index ascending (topk alone leaves
    the order of equal values unspecified)."""
    vals, idx = torch.topk(x, k, sorted=False)
    order = torch.argsort(idx)
    vals, idx = vals[order], idx[order]
    perm = torch.sort(vals, descending=True, stable=True).indices
    return vals[perm], idx[perm]


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from fp32 logits [vocab]; deterministic given the generator's state.

    Greedy is argmax (lowest index on ties). Otherwise the logits are scaled by 1/temperature in
    float64, cut to the top_k largest, renormalized, cut to the smallest prefix (by probability)
    whose mass reaches top_p, and one uniform number from the request's generator is mapped through
    the CDF of what is left. Only the candidates are sorted (growing top-k search), so a step does
    not pay for sorting the whole vocabulary.
    """
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    x = logits.double() / params.temperature
    n = x.numel()
    if params.top_k and params.top_k < n:
        vals, idx = _top(x, params.top_k)
        logz = torch.logsumexp(vals, 0)
    elif params.top_p < 1.0:
        logz = torch.logsumexp(x, 0)
        k = min(n, 64)
        while True:
            vals, idx = _top(x, k)
            if k == n or float(torch.exp(vals - logz).sum()) >= params.top_p:
                break
            k = min(n, k * 8)
    else:
        vals, idx, logz = x, None, torch.logsumexp(x, 0)
    probs = torch.exp(vals - logz)
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        keep = int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=cum.dtype)).item()) + 1
        probs = probs[:keep]
        idx = idx[:keep]
    cdf = torch.cumsum(probs, dim=0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    j = min(int(torch.searchsorted(cdf, u.reshape(1), right=True).item()), probs.numel() - 1)
    return int(idx[j]) if idx is not None else j


class RequestSink(Protocol):
    """Where a request's results go. Called on the scheduler thread; must be quick."""

    def on_token(self, req: "Request", token_id: int) -> bool:
        """A new generated token (EOS excluded). Return True to stop here (a stop string matched)."""

    def on_finish(self, req: "Request", reason: str, error: str | None) -> None:
        """Called exactly once: reason is 'stop', 'length', 'cancelled' or 'error'."""


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: RequestSink
    rid: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    # --- scheduler-owned ---
    status: str = "new"             # new -> waiting -> running -> finished
    seq: SequenceState | None = None
    reserved: int = 0               # pool tokens held
    fed: int = 0                    # prompt tokens consumed by the engine
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    cancelled: bool = False
    gen: torch.Generator | None = None

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


class StatePool:
    """Fixed budget of sequence slots and state tokens, handed out in pages of `page` tokens."""

    def __init__(self, max_seqs: int, capacity_tokens: int, page: int = 16) -> None:
        if max_seqs < 1 or capacity_tokens < page:
            raise ValueError(f"state pool needs max_seqs >= 1 and capacity >= {page} tokens")
        self.page = page
        self.max_seqs = max_seqs
        self.total_pages = capacity_tokens // page
        self.used_pages = 0
        self.used_seqs = 0

    @property
    def capacity_tokens(self) -> int:
        return self.total_pages * self.page

    @property
    def used_tokens(self) -> int:
        return self.used_pages * self.page

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def can_ever_fit(self, tokens: int) -> bool:
        return self.pages_for(tokens) <= self.total_pages

    def try_reserve(self, tokens: int) -> bool:
        n = self.pages_for(tokens)
        if self.used_seqs >= self.max_seqs or self.used_pages + n > self.total_pages:
            return False
        self.used_pages += n
        self.used_seqs += 1
        return True

    def release(self, tokens: int) -> None:
        self.used_pages -= self.pages_for(tokens)
        self.used_seqs -= 1
        assert self.used_pages >= 0 and self.used_seqs >= 0, "state pool released more than it gave"


class Metrics:
    """Counters the /metrics endpoint renders. Written on the scheduler thread only."""

    def __init__(self) -> None:
        self.step_hist = [0] * (len(STEP_BUCKETS_S) + 1)
        self.step_sum = 0.0
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def observe_step(self, seconds: float, new_tokens: int, now: float) -> None:
        self.steps += 1
        self.step_sum += seconds
        for i, b in enumerate(STEP_BUCKETS_S):
            if seconds <= b:
                self.step_hist[i] += 1
                break
        else:
            self.step_hist[-1] += 1
        if new_tokens:
            self._recent.append((now, new_tokens))

    def tokens_per_second(self, now: float, window: float = 10.0) -> float:
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        return sum(n for _, n in self._recent) / window


class Scheduler:
    def __init__(self, engine: Engine, *, max_seqs: int = 8, capacity: int | None = None,
                 chunk: int = 256, queue_limit: int = 256) -> None:
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        if queue_limit < 1:
            raise ValueError("queue_limit must be >= 1")
        self.engine = engine
        self.chunk = chunk
        self.queue_limit = queue_limit
        if capacity is None:
            capacity = engine.default_capacity(max_seqs)
        if capacity < 16:
            raise ValueError(f"the state pool would hold only {capacity} tokens: not enough memory")
        self.pool = StatePool(max_seqs, capacity)
        self.max_request_tokens = min(engine.max_seq_len, self.pool.capacity_tokens)
        self.metrics = Metrics()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._last_step_s = 0.0

    # ---- sizing --------------------------------------------------------------------------------
    def describe_pool(self) -> str:
        p = self.pool
        per_seq = p.capacity_tokens // p.max_seqs
        e = self.engine
        total_bytes = p.capacity_tokens * e.state_bytes_per_token + p.max_seqs * e.state_bytes_fixed
        return (f"state pool: {p.capacity_tokens} tokens in {p.total_pages} pages of {p.page}, "
                f"{p.max_seqs} sequence slots: {p.max_seqs} sequences of {per_seq} tokens fit at once, "
                f"or 1 of {self.max_request_tokens} (longest request); "
                f"~{total_bytes / 2**20:.1f} MiB of state at {e.state_bytes_per_token:.0f} B/token "
                f"+ {e.state_bytes_fixed / 2**20:.2f} MiB fixed per sequence")

    # ---- called from any thread ----------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        need = prompt_len + max_tokens
        if need > self.max_request_tokens:
            raise RequestTooLarge(
                f"this request needs {need} tokens of state ({prompt_len} prompt + {max_tokens} "
                f"max_tokens) but one sequence holds at most {self.max_request_tokens} tokens; "
                f"shorten the prompt or lower max_tokens")

    def submit(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        self.check_fits(len(req.prompt_ids), req.params.max_tokens)
        with self._cv:
            if len(self.waiting) >= self.queue_limit:
                self.metrics.rejected["queue_full"] += 1
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (queue limit {self.queue_limit})")
            req.status = "waiting"
            self.waiting.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop a request at the next step boundary and free its state (client disconnected)."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="megastep-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for req in list(self.running):
            self._finish(req, "cancelled", "server shutting down")
        with self._cv:
            pending = list(self.waiting)
            self.waiting.clear()
        for req in pending:
            req.status = "finished"
            req.sink.on_finish(req, "cancelled", "server shutting down")

    def snapshot(self) -> dict[str, float]:
        now = time.monotonic()
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "pool_tokens_used": self.pool.used_tokens,
            "pool_tokens_capacity": self.pool.capacity_tokens,
            "pool_seqs_used": self.pool.used_seqs,
            "pool_seqs_capacity": self.pool.max_seqs,
            "engine_live_sequences": self.engine.live_sequences,
            "tokens_per_second": self.metrics.tokens_per_second(now),
        }

    # ---- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.running:
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # a bug in the scheduler itself: fail what is running, keep serving
                log.exception("scheduler step failed; failing the running requests")
                for req in list(self.running):
                    self._finish(req, "error", "internal error in the scheduler")

    def step(self) -> bool:
        """Run one scheduler step. Returns False when there was nothing to do."""
        self._reap_cancelled()
        self._admit()
        rows: list[tuple[Request, list[int]]] = []
        for req in self.running:
            if req.fed == len(req.prompt_ids):
                rows.append((req, [req.output_ids[-1]]))
        for req in self.running:
            if req.fed < len(req.prompt_ids):
                rows.append((req, req.prompt_ids[req.fed:req.fed + self.chunk]))
                break
        if not rows:
            return False
        t0 = time.perf_counter()
        try:
            results: list = self.engine.forward_batch([(r.seq, ids) for r, ids in rows])
        except Exception as e:  # the engine could not run this batch at all
            log.exception("engine step failed")
            results = [e] * len(rows)
        new_tokens = 0
        for (req, ids), res in zip(rows, results):
            if isinstance(res, BaseException):
                self._finish(req, "error", f"model error: {type(res).__name__}: {res}")
                continue
            if req.fed < len(req.prompt_ids):
                req.fed += len(ids)
                self.metrics.prompt_tokens += len(ids)
                if req.fed < len(req.prompt_ids):
                    continue          # mid-prompt chunk: its logits are not needed
            if bool(torch.isnan(res.max())):   # max propagates NaN: one cheap reduction
                self._finish(req, "error", "model produced NaN logits")
                continue
            try:
                tok = sample_token(res, req.params, req.gen)
                new_tokens += 1
                self._on_sampled(req, tok)
            except Exception as e:
                log.exception("request %d failed while sampling or streaming", req.rid)
                self._finish(req, "error", f"{type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        self._last_step_s = dt
        self.metrics.observe_step(dt, new_tokens, time.monotonic())
        self.metrics.generated_tokens += new_tokens
        return True

    def _on_sampled(self, req: Request, tok: int) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(tok)
        if tok in self.engine.eos_token_ids and not req.params.ignore_eos:
            self._finish(req, "stop")
            return
        if req.sink.on_token(req, tok):
            self._finish(req, "stop")
            return
        if len(req.output_ids) >= req.params.max_tokens:
            self._finish(req, "length")

    def _reap_cancelled(self) -> None:
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, "cancelled")
        with self._cv:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            r.status = "finished"
            self.metrics.finished["cancelled"] += 1
            r.sink.on_finish(r, "cancelled", None)

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self.waiting:
                    return
                req = self.waiting[0]
                if not self.pool.try_reserve(req.total_tokens):
                    return
                self.waiting.popleft()
            req.reserved = req.total_tokens
            req.status = "running"
            seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
            req.gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
            try:
                req.seq = self.engine.new_sequence()
            except Exception as e:
                log.exception("could not create a sequence")
                self.running.append(req)
                self._finish(req, "error", f"could not allocate sequence state: {e}")
                continue
            self.running.append(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status == "finished":
            return
        req.status = "finished"
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.seq is not None:
            try:
                self.engine.free(req.seq)
            except Exception:
                log.exception("freeing sequence of request %d failed", req.rid)
            req.seq = None
        if req.reserved:
            self.pool.release(req.reserved)
            req.reserved = 0
        self.metrics.finished[reason] += 1
        try:
            req.sink.on_finish(req, reason, error)
        except Exception:
            log.exception("sink of request %d failed in on_finish", req.rid)
