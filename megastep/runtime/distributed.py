"""Expert parallelism (EP) over torch.distributed: one process per device, output bit-identical to 1 rank.

Layout. Rank r of W owns the routed experts [r*E/W, (r+1)*E/W) of every layer and loads only those
(`synthesize_rank_weights`, `load_rank_checkpoint`); attention, routers, the shared expert, the
embedding and the head are replicated. Every rank runs the same rows in the same order, so the
replicated parts give the same bits everywhere (same code, same weights, same kernels) and only the
routed experts are split.

Fixed-order combine. A MoE call selects k (row, expert) pairs. Each rank writes the outputs of the
pairs whose expert it owns into a zeroed buffer [..., k, D] (in the activation dtype, exactly the
tensor the 1-rank reference computes for that pair), and the buffer is all-reduced as integers: its
bytes viewed as int32 words (uint8 when a row is not a whole number of words), never mixing two pairs
in one word. Every word then has at most one non-zero addend and integer addition is exact and
associative, so each rank receives the owners' bits exactly, whatever order, tree or chunking the
backend (gloo, NCCL ring/tree) uses and whatever its float modes (flush-to-zero, -0.0, NaN payloads).
Every rank then sums the k pair outputs in fp32 in ascending expert id, exactly as
`ReferenceModel.moe` does, and adds the shared expert (computed while the all-reduce is in flight)
last. Same tensors, same operations, same order: same bits as 1 rank, run to run.

Bytes: a ring all-reduce moves about 2*k*D values per row and rank. An all-gather of only the owned
pairs (variable counts per rank) would halve that, and for large batches a dispatch/combine
all-to-all avoids replicated rows altogether; each keeps the argument above as long as the pair
outputs land in a fixed [row, slot] layout before the ordered sum.

Launching. `launch(fn, W)` spawns W local processes (spawn start method), hosts the rendezvous store
in the parent on a free 127.0.0.1 port (no port race), pins gloo/NCCL sockets to the loopback interface,
bounds the whole run by a deadline, forwards each rank's exception, and never leaves a process behind.
With backend "nccl", rank r runs on cuda:gpus[r]; NVLink multicast is forced off (NCCL_NVLS_ENABLE=0),
as the lent machines require.
"""

from __future__ import annotations

import io
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megastep.checkpoint.tensors import expected_tensors
from megastep.config import ModelConfig
from megastep.errors import CheckpointError, UserError
from megastep.model.reference import ReferenceModel

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0
_EXPERT_RE = re.compile(r"(?:^|\.)ffn\.experts\.(\d+)\.")


# ---- sharding ------------------------------------------------------------------------------------
def check_world_size(n_experts: int, world_size: int) -> None:
    """Raise a UserError unless `world_size` ranks can split `n_experts` routed experts evenly."""
    if world_size < 1:
        raise UserError(f"expert parallelism needs at least 1 rank, got {world_size}")
    if n_experts % world_size:
        divisors = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise UserError(
            f"cannot split {n_experts} routed experts evenly over {world_size} ranks (GPUs); "
            f"use a world size that divides {n_experts}: {', '.join(map(str, divisors))}"
        )


def experts_of(rank: int, world_size: int, n_experts: int) -> range:
    """The routed expert ids rank `rank` owns: [rank*E/W, (rank+1)*E/W)."""
    check_world_size(n_experts, world_size)
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is outside [0, {world_size})")
    per = n_experts // world_size
    return range(rank * per, (rank + 1) * per)


def expert_id(name: str) -> int | None:
    """Routed expert id of a tensor name (`layers.L.ffn.experts.E.w1.weight` -> E), else None."""
    m = _EXPERT_RE.search(name)
    return int(m.group(1)) if m else None


def is_rank_tensor(name: str, owned: range) -> bool:
    """Whether a rank holding the experts `owned` keeps tensor `name` (replicated, or an owned expert's)."""
    e = expert_id(name)
    return e is None or e in owned


def rank_weights(weights: dict[str, torch.Tensor], rank: int, world_size: int, n_experts: int) -> dict[str, torch.Tensor]:
    """The subset of a full weight dict that rank `rank` keeps (no copies)."""
    owned = experts_of(rank, world_size, n_experts)
    return {n: t for n, t in weights.items() if is_rank_tensor(n, owned)}


def synthesize_rank_weights(cfg: ModelConfig, seed: int, rank: int, world_size: int, *,
                            device: str | torch.device = "cpu", include_mtp: bool = False,
                            dtype_policy: str = "official", **synth_kw: Any) -> dict[str, torch.Tensor]:
    """Only rank `rank`'s tensors of `synthesize_weights(cfg, seed, ...)`, generated without the others
    (every tensor has its own seed, so the values are those of the full checkpoint). Further keywords
    go to `synthetic.synthesize_tensors`."""
    from megastep.checkpoint.synthetic import synthesize_tensors

    owned = experts_of(rank, world_size, cfg.n_routed_experts)
    table = expected_tensors(cfg, include_mtp=include_mtp)
    # Generation groups start at every tensor except a weight's `.scale` (generated with the weight).
    groups = [n for n in table if is_rank_tensor(n, owned)
              and not (n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in table)]
    return {n: t.to(device) for n, t in synthesize_tensors(cfg, seed, include_mtp=include_mtp,
                                                            dtype_policy=dtype_policy, names=groups,
                                                            **synth_kw)}


def load_rank_checkpoint(model_dir: str | Path, rank: int, world_size: int, device: str | torch.device = "cpu",
                         include_mtp: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`loader.load_checkpoint` for one rank: the whole checkpoint is validated from its headers,
    then only the replicated tensors and this rank's experts are read (shard by shard, through mmap)."""
    from safetensors import SafetensorError, safe_open

    from megastep.checkpoint.loader import scan_checkpoint

    scan = scan_checkpoint(model_dir)
    scan.raise_if_invalid(require_mtp=include_mtp)
    cfg = scan.cfg
    assert cfg is not None
    owned = experts_of(rank, world_size, cfg.n_routed_experts)
    order = [n for n in expected_tensors(cfg, include_mtp=include_mtp)
             if n in scan.location and is_rank_tensor(n, owned)]
    by_file: dict[str, list[str]] = {}
    for n in order:
        by_file.setdefault(scan.location[n], []).append(n)
    loaded: dict[str, torch.Tensor] = {}
    device = torch.device(device)
    for fname, names in by_file.items():
        try:
            with safe_open(str(scan.model_dir / fname), framework="pt", device="cpu") as f:
                for n in names:
                    loaded[n] = f.get_tensor(n).to(device)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {scan.model_dir / fname}: {e}") from None
    return cfg, {n: loaded[n] for n in order}


# ---- process group -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    """What a rank's function receives from `launch`."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _loopback_ifname() -> str | None:
    try:
        return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
    except OSError:
        return None


def init(world_size: int, rank: int, backend: str | None = None, *, addr: str = LOOPBACK,
         port: int | None = None, gpu: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the default process group and return this rank's device.

    With `port`, rendezvous through a TCP store at addr:port (hosted by `launch`'s parent); without,
    through torchrun's environment (`env://`). Backend "nccl" runs on cuda:`gpu` (default: `rank`),
    "gloo" on the CPU. A collective that waits longer than `timeout_s` fails instead of hanging."""
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise UserError(f"unknown torch.distributed backend {backend!r}; use gloo (CPU) or nccl (GPUs)")
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is outside [0, {world_size})")
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: required on the lent machines
        device = torch.device("cuda", rank if gpu is None else gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if port is not None and addr == LOOPBACK and (lo := _loopback_ifname()):
        # Keep both backends' data sockets on the loopback interface (they pick one by hostname otherwise).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    kw: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timeout}
    if port is not None:
        kw["store"] = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    else:
        kw["init_method"] = "env://"
    if backend == "nccl":
        kw["device_id"] = device  # binds the communicator to its GPU eagerly
    dist.init_process_group(**kw)
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the MoE combine -----------------------------------------------------------------------------
def bit_words(pairs: torch.Tensor) -> torch.Tensor:
    """The buffer's bytes as integers, never mixing two pairs (rows) in one integer: int32 when a row is
    a whole number of 4-byte words (bf16 with even D, fp32), else uint8. Both sum on gloo and NCCL."""
    if not pairs.is_contiguous():
        raise ValueError("the bit-exact combine needs a contiguous buffer")
    row_bytes = pairs.shape[-1] * pairs.element_size()
    flat = pairs.reshape(-1).view(torch.uint8)
    return flat.view(torch.int32) if row_bytes % 4 == 0 else flat


def ordered_combine(pairs: torch.Tensor, group: dist.ProcessGroup | None = None, *, async_op: bool = False):
    """Give every rank the per-pair expert outputs, bit for bit, from a buffer [..., D] in which each
    row (pair) was written by exactly one rank and is zero on all others.

    The buffer's bytes are all-reduced as integers (SUM): each integer has one non-zero addend at
    most, and integer addition is exact and associative, so the result is the owner's bits whatever
    order, tree or chunking the backend uses, and whatever its float modes (flush-to-zero, NaN
    payloads, the sign of zero never enter). In place; returns the work handle with async_op."""
    return dist.all_reduce(bit_words(pairs), op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class _PeerBuffers:
    """Per-layer buffers and arrival flags in symmetric memory (every rank maps every other rank's),
    their base addresses as device tables, and the step epoch: what a peer-to-peer combine needs.
    A collective: every rank of `group` builds it with the same sizes. NCCL only (CUDA devices with
    peer access); `available()` says whether this PyTorch build can. `begin_step()` advances the
    epoch (once per step, inside the step's graph)."""

    def __init__(self, n_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None):
        from torch.distributed import _symmetric_memory as symm

        group = group or dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.n_layers = n_layers
        self.bufs = symm.empty(n_layers, *shape, dtype=dtype, device=device)
        self.flags = symm.empty(n_layers, self.world_size, dtype=torch.int64, device=device)
        self.flags.zero_()
        handles = [symm.rendezvous(t, group) for t in (self.bufs, self.flags)]
        self.table, self.flag_table = (torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device) for h in handles)
        self._handles = handles  # keep the peers' mappings alive
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before anyone signals

    @staticmethod
    def available() -> bool:
        try:
            from torch.distributed import _symmetric_memory as symm
        except ImportError:
            return False
        return hasattr(symm, "empty") and hasattr(symm, "rendezvous")

    def begin_step(self) -> None:
        self.epoch += 1


class PeerPairs(_PeerBuffers):
    """The expert-parallel peer-to-peer combine's memory (kernels/pair_combine.py): per layer a
    [max_pairs, D] buffer of pair outputs. `buffer(L, P)` is the [P, D] view the experts kernel
    writes layer L's pairs into; `combine(L, idx, per[, shared])` the barrier, gather and ordered
    sum (plus the shared expert's output)."""

    def __init__(self, n_layers: int, max_pairs: int, dim: int, dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        if n_layers < 2:  # the barrier of the layer before is what makes one buffer per layer safe
            raise ValueError("the peer-to-peer combine needs at least two MoE layers")
        super().__init__(n_layers, (max_pairs, dim), dtype, device, group)
        self.max_pairs, self.dim = max_pairs, dim

    def buffer(self, layer: int, pairs: int) -> torch.Tensor:
        if pairs > self.max_pairs:
            raise ValueError(f"{pairs} pairs exceed the combine's {self.max_pairs} (rows x top-k)")
        return self.bufs[layer, :pairs]

    def combine(self, layer: int, idx: torch.Tensor, per: int, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed sum (fp32), or with `shared` the MoE output: routed sum + shared, rounded to its dtype."""
        from megastep.kernels.pair_combine import gather_sum_pairs

        return gather_sum_pairs(self.bufs[layer], self.table, self.flag_table, self.epoch, idx.contiguous(),
                                layer_off=layer * self.max_pairs * self.dim, flag_off=layer * self.world_size,
                                per=per, rank=self.rank, world_size=self.world_size,
                                shared=None if shared is None else shared.contiguous())


class PeerSplits(_PeerBuffers):
    """The tensor-parallel attention's combine memory (kernels/split_combine.py): per layer this
    rank's split-K partials of wo_b, fp32 [splits, max_rows, N]. `buffer(L, M)` is the
    [splits, M, N] view its partials launch writes; `combine(L, M)` the barrier, gather of every
    rank's splits and their ordered sum, rounded to bf16."""

    def __init__(self, n_layers: int, splits: int, max_rows: int, dim: int, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        if n_layers < 2:  # as PeerPairs'
            raise ValueError("the attention's peer-to-peer combine needs at least two layers")
        super().__init__(n_layers, (splits, max_rows, dim), torch.float32, device, group)
        self.splits, self.max_rows, self.dim = splits, max_rows, dim

    def buffer(self, layer: int, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the attention combine's {self.max_rows}")
        return self.bufs[layer, :, :rows]

    def combine(self, layer: int, rows: int) -> torch.Tensor:
        from megastep.kernels.split_combine import gather_sum_splits

        return gather_sum_splits(self.bufs[layer], self.table, self.flag_table, self.epoch, rows,
                                 buf_off=layer * self.splits * self.max_rows * self.dim,
                                 flag_off=layer * self.world_size, rank=self.rank, world_size=self.world_size)


class PeerCols(_PeerBuffers):
    """The lm head's vocabulary split over the ranks (kernels/split_combine.py, `gather_cols`): this
    rank's logit columns, fp32 [max_rows, V/W]. `buffer(M)` is the [M, V/W] view its head launch
    writes; `gather(M)` the barrier and the full [M, V] logits, every rank's columns in order."""

    def __init__(self, max_rows: int, cols: int, device: torch.device, group: dist.ProcessGroup | None = None):
        super().__init__(1, (max_rows, cols), torch.float32, device, group)
        self.max_rows = max_rows

    def buffer(self, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the head's {self.max_rows}")
        return self.bufs[0, :rows]

    def gather(self, rows: int) -> torch.Tensor:
        from megastep.kernels.split_combine import gather_cols

        return gather_cols(self.bufs[0], self.table, self.flag_table, self.epoch, rows, flag_off=0, rank=self.rank,
                           world_size=self.world_size)


class StepChannel:
    """Rank 0 tells the other ranks what to run, so that every rank makes the same step calls
    (each MoE call is a collective) and keeps the same per-sequence state (attention state is
    replicated). Messages are fixed-size int64 tensors broadcast over a gloo group of their own,
    whose timeout is long: a follower waits for the next request as long as the server idles.

    Message: [kind, arg, n_rows, (token, pos, slot) x n_rows, padding]; kinds below."""

    STOP, RESET, RUN = 0, 1, 2
    IDLE_TIMEOUT = timedelta(days=365)

    def __init__(self, max_rows: int, group: dist.ProcessGroup | None = None):
        self.max_rows = max_rows
        self.rank = dist.get_rank()
        self.group = group or dist.new_group(backend="gloo", timeout=self.IDLE_TIMEOUT)
        self._msg = torch.zeros(3 + 3 * max_rows, dtype=torch.int64)

    def _send(self, kind: int, arg: int = 0, rows: Sequence[tuple[int, int, int]] = ()) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends step commands")
        if len(rows) > self.max_rows:
            raise ValueError(f"{len(rows)} rows exceed the channel's {self.max_rows}")
        m = self._msg
        m[:3] = torch.tensor([kind, arg, len(rows)])
        if rows:
            m[3:3 + 3 * len(rows)] = torch.tensor(rows, dtype=torch.int64).reshape(-1)
        dist.broadcast(m, 0, group=self.group)

    def reset(self, slot: int) -> None:
        self._send(self.RESET, slot)

    def run(self, runner: int, rows: Sequence[tuple[int, int, int]]) -> None:
        self._send(self.RUN, runner, rows)

    def stop(self) -> None:
        self._send(self.STOP)

    def receive(self) -> tuple[int, int, list[tuple[int, int, int]]]:
        """(kind, arg, rows) of rank 0's next command (blocks until it comes)."""
        dist.broadcast(self._msg, 0, group=self.group)
        kind, arg, n = self._msg[:3].tolist()
        flat = self._msg[3:3 + 3 * n].tolist()
        return kind, arg, [tuple(flat[i:i + 3]) for i in range(0, 3 * n, 3)]


class ExpertParallelReference(ReferenceModel):
    """The reference decode with routed experts sharded over ranks; logits bit-identical to
    `ReferenceModel` on the full weights, on every rank.

    `weights` may be the full dict or only this rank's tensors (see `synthesize_rank_weights`,
    `load_rank_checkpoint`); only this rank's experts are kept. With world_size > 1 the default
    process group (or `group`) must be initialized with matching rank and size, and every rank
    must make the same forward calls in the same order (each MoE call is one collective)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, rank: int = 0,
                 world_size: int = 1, group: dist.ProcessGroup | None = None, **kw: Any):
        self.experts = experts_of(rank, world_size, cfg.n_routed_experts)
        self.rank, self.world_size, self.group = rank, world_size, group
        if world_size > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"world size {world_size} needs torch.distributed initialized (runtime.distributed.init)")
            got = (dist.get_rank(group), dist.get_world_size(group))
            if got != (rank, world_size):
                raise RuntimeError(f"process group is rank {got[0]} of {got[1]}, model built for rank {rank} of {world_size}")
        mine = rank_weights(weights, rank, world_size, cfg.n_routed_experts)
        missing = [f"layers.{L}.ffn.experts.{e}.w1.weight" for L in range(cfg.num_hidden_layers) for e in self.experts]
        missing = [n for n in missing if n not in mine]
        if missing:
            raise CheckpointError(f"rank {rank} of {world_size} lacks {len(missing)} of its expert tensors, e.g. {missing[0]}")
        super().__init__(cfg, mine, **kw)

    def moe(self, x: torch.Tensor, L: int, token: int) -> torch.Tensor:
        p = f"layers.{L}.ffn"
        idx, w = self.route(x, L, token)  # replicated router: the same pairs on every rank
        ids = idx.tolist()
        pairs = torch.zeros(len(ids), x.shape[-1], dtype=x.dtype, device=x.device)
        for slot, e in enumerate(ids):
            if e in self.experts:
                pairs[slot] = self.expert(x, f"{p}.experts.{e}", w[slot])
        work = ordered_combine(pairs, self.group, async_op=True) if self.world_size > 1 else None
        shared = self.expert(x, p + ".shared_experts")  # overlaps the collective
        if work is not None:
            work.wait()
        y = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        for slot in torch.argsort(idx).tolist():  # ascending expert id, exactly as ReferenceModel.moe
            y += pairs[slot].float()
        y += shared.float()
        return y.to(x.dtype)


# ---- launching W local processes -----------------------------------------------------------------
def parse_gpus(spec: str) -> list[int]:
    """'0,1,2,3' -> [0, 1, 2, 3] (the future `--gpus` flag); distinct non-negative ids."""
    try:
        gpus = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated GPU ids like 0,1,2,3, got {spec!r}") from None
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus takes distinct non-negative GPU ids like 0,1,2,3, got {spec!r}")
    return gpus


def _rank_main(fn, rank: int, world_size: int, backend: str, port: int, gpus, threads: int, args, results,
               timeout_s: float) -> None:
    torch.set_num_threads(threads)
    code = 1
    try:
        device = init(world_size, rank, backend, port=port, gpu=None if gpus is None else gpus[rank], timeout_s=timeout_s)
        out = fn(Rank(rank, world_size, device, backend), *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        tb = traceback.format_exc()
        try:
            payload = io.BytesIO()
            torch.save(e, payload)
            results.put((rank, False, (payload.getvalue(), tb)))
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
            results.put((rank, False, (None, tb)))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - a torn-down peer must not block this process's exit
            pass
        # Deliver the result, then leave without the interpreter's teardown (~2 s with torch loaded,
        # paid by every rank of every launch); nothing else of value lives in this process.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(procs: Iterable) -> None:
    """End the given processes (only those launch started), politely then firmly."""
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, backend: str | None = None,
           gpus: Sequence[int] | None = None, threads: int | None = None,
           timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run `fn(Rank, *args)` in `world_size` fresh local processes joined in one process group and
    return their results by rank. `fn` must be importable (module level); results travel by
    torch.save. Each rank uses `threads` intra-op threads (default: the CPUs shared out evenly; CPU
    results can depend on the thread count, so compare runs with equal counts). The first failing rank's exception is re-raised here (its traceback attached as a
    note) and the other ranks are stopped; past `timeout_s` all are stopped and TimeoutError raised
    (None: no deadline, e.g. a server; a collective still fails after DEFAULT_TIMEOUT_S).
    Every process has exited when this returns or raises."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    backend = backend or default_backend()
    if world_size < 1:
        raise UserError(f"need at least 1 rank, got {world_size}")
    if backend == "nccl":
        gpus = list(gpus) if gpus is not None else list(range(world_size))
        if len(gpus) != world_size:
            raise UserError(f"{world_size} ranks need {world_size} GPU ids, got {list(gpus)}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent hosts the rendezvous store on a port the OS picks: no free-port race with others.
    pg_timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    procs = [ctx.Process(target=_rank_main, daemon=True, name=f"megastep-rank{r}",
                         args=(fn, r, world_size, backend, store.port, gpus, threads, tuple(args), results,
                               pg_timeout_s))
             for r in range(world_size)]
    deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world_size}-rank run did not finish within {timeout_s:.0f} s "
                                   f"(ranks done: {sorted(out)})")
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    time.sleep(0.2)  # a result put just before exit may still be in flight
                    if results.empty():
                        raise RuntimeError(f"{dead[0].name} died with exit code {dead[0].exitcode} "
                                           "without reporting") from None
                continue
            if ok:
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                continue
            exc_bytes, tb = payload
            exc = torch.load(io.BytesIO(exc_bytes), weights_only=False) if exc_bytes else None
            if isinstance(exc, Exception):
                exc.add_note(f"raised on rank {rank} of {world_size}:\n{tb}")
                raise exc
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
        for p in procs:  # each exits right after reporting
            p.join(max(1.0, min(deadline - time.monotonic(), 60.0)))
        return [out[r] for r in range(world_size)]
    finally:
        _stop(procs)
        results.close()
        del store
