"""Expert placement: which routed experts live in HBM and which in (pinned) host memory (issue 4).

A V4-Flash checkpoint is ~160 GB of main-model weights, ~147 GB of them routed experts, against
141 GB of HBM. Everything that is not a routed expert (attention, shared experts, norms, router,
embedding, head: "resident" bytes) stays in HBM; the HBM left within the budget is filled with
routed experts, the rest go to host memory where a step reads them over the host link (GPU
zero-copy) or computes them on the CPU.

The choice is greedy by expected routing slots per byte. Every routed expert of a config has the
same size, so this is: sort every (layer, expert) pair by its share of its layer's routing slots
(from a routing profile, `megastep.routing`), hottest first, and take pairs while they fit. Ties
(the whole order, without a profile) go to each layer's hottest expert first: all layers' rank-0
experts, then all rank-1 experts, ..., each layer's ranks ordered by (count desc, expert id), then
by layer id. Uniform routing thus spreads the cold experts evenly over the layers, so every layer
has the same host-side work to overlap with its GPU work. Since all layers route the same number
of slots per token, the plan minimizes the expected cold share of routing slots for the budget.

The budget covers weights only: per-sequence state (KV, compressor and index caches), activations,
CUDA graph workspaces and the CUDA context need HBM beyond it. MTP weights are not placed.

`--hbm-budget auto` (`auto_budget_bytes`) takes what the device has free when the run starts, less
that: every routed expert kept in HBM is one fewer read over the host link per step that routes to
it (~262 us each for V4-Flash at ~51 GB/s), so a budget left unused is time lost.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from megastep.checkpoint.tensors import expected_tensors
from megastep.config import ModelConfig
from megastep.errors import UserError

GB = 1e9  # --hbm-budget and every size printed are decimal GB, as `megastep inspect` prints them
# Held back by `--hbm-budget auto` beyond the state pools and a layer's build: the graphs' activations
# and workspaces, the logits, the allocator's rounding, and the bench's 4 GiB bandwidth buffer.
AUTO_MARGIN_BYTES = 4 << 30
# Host-path bandwidths for the modeled host time that describe() prints (shared/DESIGN.md,
# measured on the lent H200 host): one path (GPU zero-copy reads of pinned memory or 16 CPU
# threads) ~50 GB/s; both at once ~100 GB/s.
HOST_PATH_GBPS = (50.0, 100.0)
BATCHES = (1, 6)  # decode rows per step described: one sequence, and a 6-row (speculative) block


# ---- bytes from the official tensor table -------------------------------------------------------
def routed_expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of one routed expert as the official checkpoint stores it: w1, w2, w3 weights plus
    their scales (MXFP4 + E8M0 for V4-Flash: 13,369,344 bytes)."""
    table = expected_tensors(cfg, include_mtp=False)
    p = "layers.0.ffn.experts.0."
    return sum(s.nbytes for n, s in table.items() if n.startswith(p))


def resident_bytes(cfg: ModelConfig) -> int:
    """Bytes of every main-model tensor that is not a routed expert (these stay in HBM)."""
    table = expected_tensors(cfg, include_mtp=False)
    return sum(s.nbytes for s in table.values() if s.role != "routed_expert")


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where every routed expert of the main layers lives. `order` lists every (layer, expert)
    pair in placement order; its first `n_hot` pairs are in HBM, the rest in host memory."""

    num_layers: int
    n_experts: int
    top_k: int
    expert_bytes: int
    fixed_bytes: int  # resident (non-routed-expert) bytes, in HBM
    budget_bytes: int
    order: tuple[tuple[int, int], ...]
    n_hot: int
    shares: tuple[tuple[float, ...], ...]  # [layer][expert]: share of the layer's routing slots
    profile_kind: str = "uniform"  # the profile's source kind; "uniform" when assumed
    notes: tuple[str, ...] = field(default=())

    # ---- sets ------------------------------------------------------------------------------
    @functools.cached_property
    def _hot_mask(self) -> list[list[bool]]:
        m = [[False] * self.n_experts for _ in range(self.num_layers)]
        for L, e in self.order[: self.n_hot]:
            m[L][e] = True
        return m

    def is_hot(self, layer: int, expert: int) -> bool:
        return self._hot_mask[layer][expert]

    def hot(self, layer: int) -> list[int]:
        """Expert ids of `layer` in HBM, ascending."""
        return [e for e, h in enumerate(self._hot_mask[layer]) if h]

    def cold(self, layer: int) -> list[int]:
        """Expert ids of `layer` in host memory, ascending."""
        return [e for e, h in enumerate(self._hot_mask[layer]) if not h]

    def hot_per_layer(self) -> list[int]:
        return [sum(r) for r in self._hot_mask]

    def slot_table(self) -> torch.Tensor:
        """int32 [layers, experts]: for an HBM expert its index among the layer's HBM experts
        (ascending id), for a host expert -1 - its index among the layer's host experts. The
        layout a MoE kernel can take to find each selected expert's weights."""
        t = torch.empty(self.num_layers, self.n_experts, dtype=torch.int32)
        for L in range(self.num_layers):
            h = c = 0
            for e, hot in enumerate(self._hot_mask[L]):
                if hot:
                    t[L, e], h = h, h + 1
                else:
                    t[L, e], c = -1 - c, c + 1
        return t

    # ---- bytes and expectations ------------------------------------------------------------
    @property
    def n_total(self) -> int:
        return self.num_layers * self.n_experts

    @property
    def n_cold(self) -> int:
        return self.n_total - self.n_hot

    @property
    def hbm_bytes(self) -> int:
        return self.fixed_bytes + self.n_hot * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return self.n_cold * self.expert_bytes

    def layer_cold_fraction(self, layer: int) -> float:
        m = self._hot_mask[layer]
        return sum(s for s, h in zip(self.shares[layer], m) if not h)

    @property
    def cold_fraction(self) -> float:
        """Expected share of all routing slots that select a host-memory expert (each layer
        routes the same number of slots per token, so the mean of the layers' shares)."""
        return sum(self.layer_cold_fraction(L) for L in range(self.num_layers)) / self.num_layers

    def expert_reads_per_step(self, batch: int = 1) -> tuple[float, float]:
        """Expected (HBM, host) distinct routed experts touched by one decode step of `batch`
        tokens, each token routing independently by the profile (P(token picks e) = k * share)."""
        hot = cold = 0.0
        for L in range(self.num_layers):
            for e, (s, h) in enumerate(zip(self.shares[L], self._hot_mask[L])):
                p = min(1.0, self.top_k * s)
                used = 1.0 - (1.0 - p) ** batch
                if h:
                    hot += used
                else:
                    cold += used
        return hot, cold

    def cold_bytes_per_step(self, batch: int = 1) -> float:
        return self.expert_reads_per_step(batch)[1] * self.expert_bytes

    # ---- output ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes, "hbm_bytes": self.hbm_bytes, "host_bytes": self.host_bytes,
            "fixed_bytes": self.fixed_bytes, "expert_bytes": self.expert_bytes,
            "experts_hbm": self.n_hot, "experts_host": self.n_cold, "cold_fraction": self.cold_fraction,
            "cold_bytes_per_step": {str(b): self.cold_bytes_per_step(b) for b in BATCHES},
            "hot_per_layer": self.hot_per_layer(), "profile": self.profile_kind, "notes": list(self.notes),
        }

    def describe(self) -> str:
        """What `megastep inspect DIR --hbm-budget GB` prints."""
        uniform = self.profile_kind == "uniform"
        lines = [
            f"expert placement for an HBM budget of {_gb(self.budget_bytes)} (weights only; state, activations "
            f"and workspaces need HBM beyond it):",
            f"  routed experts: {self.num_layers} layers x {self.n_experts} = {self.n_total}, "
            f"{self.expert_bytes / 1e6:.2f} MB each, {_gb(self.n_total * self.expert_bytes)} in all",
            f"  HBM:  {_gb(self.hbm_bytes)} = {_gb(self.fixed_bytes)} resident (attention, shared experts, "
            f"embed, head, ...) + {_gb(self.n_hot * self.expert_bytes)} routed experts "
            f"({self.n_hot}, {self.n_hot / self.n_total:.1%}); {_gb(self.budget_bytes - self.hbm_bytes)} of the budget unused",
            f"  host: {_gb(self.host_bytes)} pinned, {self.n_cold} routed experts ({self.n_cold / self.n_total:.1%})",
            f"  expected cold share of routing slots: {self.cold_fraction:.1%} "
            + ("(uniform routing ASSUMED: no profile given; `megastep profile-routing` measures one)"
               if uniform else f"(from a {self.profile_kind} routing profile)"),
        ]
        per = []
        for b in BATCHES:
            c = self.cold_bytes_per_step(b)
            t = ", ".join(f"{c / (g * 1e9) * 1e3:.2f} ms at {g:.0f} GB/s" for g in HOST_PATH_GBPS)
            per.append(f"batch {b}: {_gb(c)} ({t})")
        lines.append("  cold expert bytes per decode step: " + "; ".join(per))
        hot = self.hot_per_layer()
        lines.append(f"  HBM experts per layer (of {self.n_experts}): " + _runs(hot))
        if self.n_cold and not uniform:
            cf = [self.layer_cold_fraction(L) for L in range(self.num_layers)]
            lines.append(f"  cold share per layer: {min(cf):.1%}-{max(cf):.1%}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def auto_budget_bytes(cfg: ModelConfig, device: torch.device, *, max_seqs: int, max_ctx: int,
                      max_block: int = 1) -> int:
    """The weight budget of `--hbm-budget auto`: the device's free memory now, less the fast path's
    state pools for `max_seqs` x `max_ctx`, less what building one layer holds for a moment (its
    routed experts stacked, and the HBM copies taken from the stack: twice a layer's experts),
    less AUTO_MARGIN_BYTES. Call it before the weights are built."""
    from megastep.model.state_pools import StatePools

    free, _ = torch.cuda.mem_get_info(device)
    # the pools' layout without allocating them ("meta" tensors have shapes and no storage)
    state = StatePools(cfg, max_seqs, max_ctx, torch.bfloat16, "meta", max_block=max_block).bytes()
    building = 2 * cfg.n_routed_experts * routed_expert_bytes(cfg)
    return max(0, free - state - building - AUTO_MARGIN_BYTES)


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _runs(values: list[int]) -> str:
    """'0-2: 5, 3: 4' for [5, 5, 5, 4]: runs of equal values by layer."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{span}: {values[start]}")
            start = i
    return ", ".join(out)


def plan_placement(cfg: ModelConfig, profile: Mapping[str, Any] | None, hbm_budget_bytes: int,
                   expert_bytes: int | None = None, fixed_bytes: int | None = None) -> Placement:
    """Choose the (layer, expert) pairs kept in HBM within `hbm_budget_bytes` (see the module
    docstring). `profile`: a routing profile (megastep.routing) or None for uniform routing.
    `expert_bytes` (one routed expert) and `fixed_bytes` (resident weights) default to the
    official tensor table of `cfg`. The plan never exceeds the budget and leaves less than one
    expert's bytes of it unused unless every expert fits."""
    from megastep.routing import is_uniform, uniform_profile, validate_profile

    eb = routed_expert_bytes(cfg) if expert_bytes is None else int(expert_bytes)
    fixed = resident_bytes(cfg) if fixed_bytes is None else int(fixed_bytes)
    budget = int(hbm_budget_bytes)
    if eb <= 0 or fixed < 0:
        raise ValueError("expert_bytes must be > 0 and fixed_bytes >= 0")
    if budget < 0:
        raise UserError(f"HBM budget must be >= 0, got {budget / GB:.2f} GB")
    if budget < fixed:
        raise UserError(f"HBM budget {_gb(budget)} is below the {_gb(fixed)} of weights that must stay in HBM "
                        "(everything but the routed experts); give at least that much")
    notes: list[str] = []
    if profile is None:
        profile = uniform_profile(cfg)
    else:
        notes += validate_profile(profile, cfg)
    kind = "uniform" if is_uniform(profile) else str(profile.get("source", {}).get("kind", "supplied"))

    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    counts = profile["counts"]
    # Shares in float64: one IEEE division per expert, so equal counts give equal keys and the
    # order is the same on every machine.
    shares = tuple(tuple(float(c) / float(sum(row)) for c in row) for row in map(list, counts))
    keyed = []
    for layer in range(L):
        ranked = sorted(range(E), key=lambda e: (-shares[layer][e], e))
        for rank, e in enumerate(ranked):
            # Equal bytes per expert: slots per byte orders as the share; ties -> rank, layer.
            keyed.append((-shares[layer][e], rank, layer, e))
    keyed.sort()
    order = tuple((layer, e) for _, _, layer, e in keyed)
    n_hot = min(L * E, (budget - fixed) // eb)
    return Placement(L, E, cfg.num_experts_per_tok, eb, fixed, budget, order, n_hot, shares, kind, tuple(notes))


def describe_with_budget(model_dir: str | Path, hbm_budget_gb: float,
                         profile: Mapping[str, Any] | str | Path | None = None) -> str:
    """The placement section of `megastep inspect DIR --hbm-budget GB`, from config.json and the
    shard headers only (no tensor data: instant for a full checkpoint). `profile`: a profile
    dict, a path to a profile JSON, or None for uniform routing (the text says it is assumed)."""
    from megastep.checkpoint.loader import scan_checkpoint
    from megastep.routing import load_profile

    try:
        gb = float(hbm_budget_gb)
    except (TypeError, ValueError):
        raise UserError(f"--hbm-budget must be a number of GB, got {hbm_budget_gb!r}") from None
    if not gb >= 0 or gb == float("inf"):
        raise UserError(f"--hbm-budget must be a finite number of GB >= 0, got {hbm_budget_gb!r}")
    scan = scan_checkpoint(model_dir)
    if scan.cfg is None:
        scan.raise_if_invalid(require_mtp=False)
    cfg = scan.cfg
    assert cfg is not None
    if isinstance(profile, (str, Path)):
        profile = load_profile(profile, cfg)
    return plan_placement(cfg, profile, round(gb * GB)).describe()
