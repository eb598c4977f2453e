"""Routing profiles (which experts a model actually picks) and the skewed routing model used for
benchmarks of expert placement (issue 4).

## Routing profile
`collect_routing_profile` runs the reference decode over prompts (token id lists) and counts, per
layer, how often each routed expert is selected: score layers through the gate's top-k, hash
layers through `tid2eid`. The result is a JSON-ready dict:

    {"format": "megastep-routing-profile", "version": 1,
     "config_hash": "...",                 # config_hash(cfg): sha256 of the canonical config.json
     "num_layers": L, "n_routed_experts": E, "top_k": k, "hash_layers": [0, ...],
     "tokens": N,                          # tokens routed (prompt tokens + generated tokens)
     "counts": [[c_0, ..., c_{E-1}], ...], # one row per layer; each row sums to N * k
     "layer_totals": [N * k, ...], "total_slots": L * N * k,
     "source": {...}}                      # how it was collected (informational)

A profile written elsewhere (e.g. from real routing traces) needs only `num_layers`,
`n_routed_experts`, `top_k` and `counts`; `validate_profile` checks it against a config and turns
any mismatch into one `UserError`.

## Skewed routing model (for benchmarks)
Synthetic checkpoints draw every gate's bias as N(0, 0.1) (the `default` model below). That is
neither uniform nor realistic: on random unit-RMS activations the top 25% of experts of a layer
take ~37% of the routing slots at the tiny/small presets and ~50% at V4-Flash width (256
experts), because a bias of std 0.1 is not small against the sqrtsoftplus scores' spread of ~0.28.
Public V4.1 routing traces show the top 25% of experts of a layer covering ~60-75% of the routing
slots. The models:

- `default`: the synthetic generator's own draw (unchanged, so existing checkpoints keep their bytes).
- `uniform`: gate bias 0. Only the random gate weights rank experts: top-25% coverage ~0.26-0.28
  (25% is the exact uniform value; what is left comes from experts whose gate rows are longer).
  `tid2eid` is left as drawn (uniform over experts).
- `skewed`: score layers get `bias_e = s * z_e`, z ~ N(0, 1) per expert (seeded from the seed and
  the gate's name), and s fitted per layer by bisection so that the top 25% of experts (ranked by
  measured count) cover `target` (default 0.675, the middle of the measured range) of the routing
  slots of `CALIBRATION_TOKENS` random unit-RMS activations (rounded to bf16, as the reference
  feeds the gate) passed through that layer's actual gate weight (sqrtsoftplus scores + bias,
  top-k). Hash layers get a `tid2eid` whose rows are drawn by Gumbel top-k with expert log-weights
  `s * z_e` (k distinct experts per token id), s fitted the same way over uniform token ids.
  Calibration always runs on the CPU in fp32 so the bytes do not depend on the device.

Measured top-25% coverage (held-out random activations | through the reference decode, random
prompt ids + greedy continuation): skewed tiny 0.673-0.684 | 0.654-0.666 (1024 tokens), small
0.671-0.676 | 0.656-0.692 (384 tokens), V4-Flash geometry (all 43 gates) 0.669-0.684 | -;
uniform 0.26-0.28 | 0.27-0.32; default 0.32-0.41 (tiny/small), 0.50-0.56 (V4-Flash score layers).
The fit pins the top quarter only: with a Gaussian z the coldest experts of a layer get very
little traffic (at V4-Flash geometry the coldest 14% take ~0.7% of slots), a lighter cold tail
than a Zipf-like real profile may have, so cold-path numbers under `skewed` are a best case.
Fitting all 43 V4-Flash gates takes ~50 s on 2 CPU cores.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from megastep.checkpoint.synthetic import ROUTING_MODELS, tensor_seed
from megastep.config import ModelConfig
from megastep.errors import UserError

PROFILE_FORMAT = "megastep-routing-profile"
PROFILE_VERSION = 1
SKEW_TARGET = 0.675  # middle of the 60-75% range measured on public V4.1 routing traces
HOT_FRACTION = 0.25  # "top 25% of experts"
CALIBRATION_TOKENS = 8192


# ---- profiles -----------------------------------------------------------------------------------
def config_hash(cfg: ModelConfig) -> str:
    """Stable short hash of a config: sha256 of its canonical config.json (sorted keys)."""
    blob = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def top_coverage(counts: Sequence[float] | torch.Tensor, fraction: float = HOT_FRACTION) -> float:
    """Share of a layer's routing slots taken by its `fraction` most-selected experts."""
    c = torch.as_tensor(counts, dtype=torch.float64).flatten().sort(descending=True).values
    total = float(c.sum())
    if total <= 0:
        return 0.0
    n = max(1, round(c.numel() * fraction))
    return float(c[:n].sum()) / total


def make_profile(cfg: ModelConfig, counts: torch.Tensor | Sequence[Sequence[int]], tokens: int,
                 source: Mapping[str, Any] | None = None) -> dict:
    """A profile dict from per-layer counts [L, E] of `tokens` routed tokens."""
    rows = counts.tolist() if isinstance(counts, torch.Tensor) else [list(r) for r in counts]
    rows = [[int(c) for c in r] for r in rows]
    totals = [sum(r) for r in rows]
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "config_hash": config_hash(cfg),
        "num_layers": cfg.num_hidden_layers,
        "n_routed_experts": cfg.n_routed_experts,
        "top_k": cfg.num_experts_per_tok,
        "hash_layers": [L for L in range(cfg.num_hidden_layers) if cfg.is_hash_layer(L)],
        "tokens": int(tokens),
        "counts": rows,
        "layer_totals": totals,
        "total_slots": sum(totals),
        "source": dict(source or {}),
    }


def uniform_profile(cfg: ModelConfig) -> dict:
    """Every expert of every layer equally likely (what placement assumes without a profile)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    # E tokens' worth of slots, spread evenly: each expert k times.
    return make_profile(cfg, [[k] * E for _ in range(cfg.num_hidden_layers)], E,
                        {"kind": "uniform", "note": "assumed uniform routing, not measured"})


def is_uniform(profile: Mapping[str, Any]) -> bool:
    return profile.get("source", {}).get("kind") == "uniform"


def _load_source(source) -> tuple[ModelConfig, dict[str, torch.Tensor], str | None]:
    if isinstance(source, (str, Path)):
        from megastep.checkpoint.loader import load_checkpoint

        cfg, weights = load_checkpoint(source, progress=False)
        return cfg, weights, str(source)
    try:
        cfg, weights = source
    except (TypeError, ValueError):
        raise TypeError("source must be a model directory or a (ModelConfig, weights) pair") from None
    return cfg, weights, None


def collect_routing_profile(source, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 0,
                            device: str | torch.device | None = None, quant_sim: bool = True,
                            progress: Callable[[int, int], None] | None = None) -> dict:
    """Run the reference decode over each prompt (a fresh sequence each) and count, per layer, how
    often each routed expert is selected. `source` is a model directory or (cfg, weights).

    With `max_new_tokens` > 0 each prompt is continued greedily and the generated tokens are
    routed and counted too (decode routing, which is what placement serves). `progress(done,
    total)` is called after each prompt. Every prompt token and every generated token that is fed
    back counts once: counts of each layer sum to tokens * top_k.
    """
    from megastep.model.reference import ReferenceModel

    if max_new_tokens < 0:
        raise UserError("max_new_tokens must be >= 0")
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise UserError("no prompts: give at least one prompt to profile routing over")
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"prompt {i} is empty: give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise UserError(f"prompt {i} must be a list of integer token ids")
    cfg, weights, model_dir = _load_source(source)
    counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64)

    class CountingReference(ReferenceModel):
        def route(self, x, L, token):
            idx, w = super().route(x, L, token)
            counts[L].index_add_(0, idx.cpu(), torch.ones(idx.numel(), dtype=torch.int64))
            return idx, w

    model = CountingReference(cfg, weights, quant_sim=quant_sim, device=device)
    tokens = 0
    for i, ids in enumerate(prompts):
        if len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise UserError(f"prompt {i} of {len(ids)} tokens plus {max_new_tokens} new tokens exceeds "
                            f"the model's limit of {cfg.max_position_embeddings} tokens")
        state = model.new_state()
        logits = model.forward(state, ids)[-1]
        tokens += len(ids)
        for _ in range(max_new_tokens):
            t = int(logits.argmax())
            logits = model.forward(state, [t])[-1]
            tokens += 1
        if progress is not None:
            progress(i + 1, len(prompts))
    src = {"kind": "reference-decode", "prompts": len(prompts), "max_new_tokens": max_new_tokens,
           "quant_sim": quant_sim}
    if model_dir is not None:
        src["model_dir"] = model_dir
    return make_profile(cfg, counts, tokens, src)


def profile_from_random_activations(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *,
                                    tokens: int = CALIBRATION_TOKENS, seed: int = 1) -> dict:
    """A profile without running the model: unit-RMS random activations through each score layer's
    gate, uniform random token ids through each hash layer's tid2eid. Instant at full V4-Flash
    geometry, so a benchmark on synthetic weights can place experts by the routing its own gates
    produce (the activations are not the model's, so this is a model of the profile, not a
    measurement of it)."""
    counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64)
    for L in range(cfg.num_hidden_layers):
        idx = random_routes(cfg, weights, L, tokens, seed)
        counts[L] = torch.bincount(idx.flatten().long(), minlength=cfg.n_routed_experts)
    return make_profile(cfg, counts, tokens, {"kind": "random-activations", "seed": seed})


def random_routes(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, n: int, seed: int,
                  tag: str = "profile") -> torch.Tensor:
    """[n, top_k] experts that `layer` routes n random rows to (CPU): unit-RMS random activations
    through a score layer's gate and bias, uniform random token ids through a hash layer's tid2eid.
    The draws are seeded by (seed, the layer's gate, `tag`)."""
    prefix = gate_prefix(layer)
    if cfg.is_hash_layer(layer):
        g = torch.Generator().manual_seed(tensor_seed(seed, f"{prefix}/{tag}-tokens"))
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        return weights[prefix + ".tid2eid"].cpu()[ids]
    scores = _gate_scores(weights[prefix + ".weight"], n, tensor_seed(seed, f"{prefix}/{tag}-acts"))
    return (scores + weights[prefix + ".bias"].cpu().float()).topk(cfg.num_experts_per_tok, dim=-1).indices


def validate_profile(profile: Any, cfg: ModelConfig, *, strict_config: bool = False) -> list[str]:
    """Check a profile against `cfg`: raise one UserError listing every structural problem (layer
    or expert counts, top-k, negative or non-numeric counts, rows that do not sum to tokens *
    top_k). Returns notes that do not prevent its use (a profile collected on another config of
    the same routing geometry); with `strict_config` such a config mismatch is an error too."""
    if not isinstance(profile, Mapping):
        raise UserError("routing profile must be a JSON object")
    p: list[str] = []
    notes: list[str] = []
    fmt = profile.get("format", PROFILE_FORMAT)
    if fmt != PROFILE_FORMAT:
        p.append(f"format is {fmt!r}, expected {PROFILE_FORMAT!r}")
    if profile.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        p.append(f"version {profile.get('version')!r} is not supported (this megastep reads version {PROFILE_VERSION})")
    L, E, k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    for key, want in (("num_layers", L), ("n_routed_experts", E), ("top_k", k)):
        if key not in profile:
            p.append(f"no {key!r} (the model has {want})")
        elif profile[key] != want:
            p.append(f"{key} is {profile[key]!r} but the model has {want}")
    counts = profile.get("counts")
    if not isinstance(counts, list):
        p.append("no 'counts' list (one list of per-expert counts per layer)")
    else:
        if len(counts) != L:
            p.append(f"counts has {len(counts)} layers, the model has {L}")
        bad_len = [i for i, r in enumerate(counts) if not isinstance(r, list) or len(r) != E]
        if bad_len:
            p.append(f"counts of layer{'s' * (len(bad_len) > 1)} {_few(bad_len)} do not hold {E} experts each")
        good = [i for i, r in enumerate(counts) if i not in bad_len]
        bad_val = [i for i in good if not all(_count_ok(c) for c in counts[i])]
        if bad_val:
            p.append(f"counts of layer{'s' * (len(bad_val) > 1)} {_few(bad_val)} hold negative or non-numeric values")
        empty = [i for i in good if i not in bad_val and sum(counts[i]) <= 0]
        if empty:
            p.append(f"layer{'s' * (len(empty) > 1)} {_few(empty)} {'have' if len(empty) > 1 else 'has'} no routing counts")
        tokens = profile.get("tokens")
        if tokens is not None and not p and profile.get("top_k") == k:
            want = tokens * k
            off = [i for i, r in enumerate(counts) if abs(sum(r) - want) > 1e-6 * max(1, want)]
            if off:
                p.append(f"counts of layer{'s' * (len(off) > 1)} {_few(off)} do not sum to tokens x top_k = {want}")
    if p:
        raise UserError("routing profile does not fit this model:\n  - " + "\n  - ".join(p))
    h = profile.get("config_hash")
    if h is not None and h != config_hash(cfg):
        msg = "the profile was collected on another config.json (same routing geometry)"
        if strict_config:
            raise UserError(f"routing profile does not fit this model: {msg}")
        notes.append(msg)
    return notes


def _count_ok(c: Any) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0


def _few(items: list[int], cap: int = 8) -> str:
    s = ", ".join(map(str, items[:cap]))
    return s + (f" and {len(items) - cap} more" if len(items) > cap else "")


def save_profile(profile: Mapping[str, Any], path: str | Path) -> None:
    """Write a profile as JSON (one line per layer of counts, so a diff stays readable)."""
    head = {k: v for k, v in profile.items() if k != "counts"}
    text = json.dumps(head, indent=2)[:-2]
    rows = ",\n".join("    " + json.dumps(r) for r in profile["counts"])
    Path(path).write_text(f'{text},\n  "counts": [\n{rows}\n  ]\n}}\n')


def load_profile(path: str | Path, cfg: ModelConfig | None = None) -> dict:
    """Read a profile JSON file; with `cfg`, validate it against the model (UserError if it does
    not fit)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no routing profile at {path}")
    try:
        profile = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"routing profile {path} is not valid JSON: {e}") from None
    if cfg is not None:
        validate_profile(profile, cfg)
    elif not isinstance(profile, dict):
        raise UserError(f"routing profile {path} must hold a JSON object")
    return profile


def profile_summary(profile: Mapping[str, Any]) -> str:
    """Lines for the CLI: what was profiled and how concentrated each layer's routing is."""
    cov = [top_coverage(r) for r in profile["counts"]]
    hashes = set(profile.get("hash_layers", []))
    src = profile.get("source", {})
    lines = [f"routing profile: {profile.get('tokens', '?')} tokens, {profile['num_layers']} layers x "
             f"{profile['n_routed_experts']} experts, top-{profile['top_k']} ({src.get('kind', 'supplied')})"]
    score = [c for i, c in enumerate(cov) if i not in hashes]
    if score:
        lines.append(f"  top {HOT_FRACTION:.0%} of experts take {min(score):.1%}-{max(score):.1%} of routing slots "
                     f"(mean {sum(score) / len(score):.1%}) on score layers")
    for i in sorted(hashes):
        if i < len(cov):
            lines.append(f"  hash layer {i}: top {HOT_FRACTION:.0%} take {cov[i]:.1%}")
    unused = [sum(1 for c in r if c == 0) for r in profile["counts"]]
    if any(unused):
        lines.append(f"  experts never selected: {sum(unused)} (most in one layer: {max(unused)})")
    return "\n".join(lines)


# ---- skewed routing model -----------------------------------------------------------------------
@dataclass(frozen=True)
class SkewFit:
    """Result of fitting one gate: the bias scale s and the coverage it gives on the fitting sample."""

    scale: float
    coverage: float


def gate_prefix(layer: int) -> str:
    return f"layers.{layer}.ffn.gate"


def _gate_scores(gate_weight: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """sqrtsoftplus scores [n, E] of n random unit-RMS activations (bf16, as the reference feeds
    the gate) through `gate_weight` [E, D], in fp32 on the CPU."""
    w = gate_weight.detach().cpu().float()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w.shape[1], generator=g)
    x = (x * torch.rsqrt(x.square().mean(-1, keepdim=True))).bfloat16().float()
    return torch.sqrt(F.softplus(x @ w.T))


def _selected_coverage(idx: torch.Tensor, E: int) -> float:
    return top_coverage(torch.bincount(idx.flatten(), minlength=E))


def _fit_scale(coverage: Callable[[float], float], target: float) -> SkewFit:
    """Smallest-error s >= 0 with coverage(s) ~ target, by doubling then bisection (coverage grows
    with s: a larger spread of the bias concentrates selection on the high-z experts)."""
    if not 0 < target < 1:
        raise ValueError(f"target coverage must be in (0, 1), got {target}")
    c0 = coverage(0.0)
    if c0 >= target:
        return SkewFit(0.0, c0)
    lo, hi = 0.0, 0.25
    while (c := coverage(hi)) < target:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"coverage {target} is out of reach (best {c:.3f})")
    best = SkewFit(hi, c)
    for _ in range(40):
        mid = (lo + hi) / 2
        c = coverage(mid)
        if abs(c - target) < abs(best.coverage - target):
            best = SkewFit(mid, c)
        if c < target:
            lo = mid
        else:
            hi = mid
        if abs(c - target) < 1e-3 or hi - lo < 1e-6:
            break
    return best


def _skew_direction(E: int, prefix: str, seed: int) -> torch.Tensor:
    """z ~ N(0, 1) per expert, from the seed and the gate's name only."""
    g = torch.Generator().manual_seed(tensor_seed(seed, prefix + "/skew"))
    return torch.randn(E, generator=g)


def fit_gate_bias(cfg: ModelConfig, gate_weight: torch.Tensor, prefix: str, *, target: float = SKEW_TARGET,
                  seed: int = 0, tokens: int = CALIBRATION_TOKENS) -> tuple[torch.Tensor, SkewFit]:
    """The skewed bias (float32 [E], CPU) of the score gate `prefix` and its fit."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    z = _skew_direction(E, prefix, seed)
    scores = _gate_scores(gate_weight, tokens, tensor_seed(seed, prefix + "/skew-acts"))
    fit = _fit_scale(lambda s: _selected_coverage((scores + s * z).topk(k, dim=-1).indices, E), target)
    return (fit.scale * z).float(), fit


def skewed_gate_bias(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, target: float = SKEW_TARGET,
                     seed: int = 0) -> torch.Tensor:
    """Gate bias (float32 [E], on the gate weight's device) of score layer `layer` such that the
    top 25% of its experts take ~`target` of the routing slots of random unit-RMS activations."""
    if cfg.is_hash_layer(layer):
        raise ValueError(f"layer {layer} is hash-routed (no gate bias); use skewed_tid2eid")
    w = weights[gate_prefix(layer) + ".weight"]
    return fit_gate_bias(cfg, w, gate_prefix(layer), target=target, seed=seed)[0].to(w.device)


def _gumbel_topk(s: float, z: torch.Tensor, rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(rows, z.numel(), generator=g).clamp_(min=1e-20)
    return (s * z - torch.log(-torch.log(u))).topk(k, dim=-1).indices


def fit_tid2eid(cfg: ModelConfig, prefix: str, *, target: float = SKEW_TARGET, seed: int = 0,
                tokens: int = CALIBRATION_TOKENS, vocab: int | None = None) -> tuple[torch.Tensor, SkewFit]:
    """A skewed tid2eid table (int64 [vocab, k], CPU) for the hash gate `prefix`: each row holds k
    distinct experts drawn by Gumbel top-k with log-weights s * z, s fitted so that over uniform
    token ids the top 25% of experts take ~`target` of the slots."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    vocab = cfg.vocab_size if vocab is None else vocab
    z = _skew_direction(E, prefix, seed)
    fit_seed = tensor_seed(seed, prefix + "/skew-fit")

    def coverage(s: float) -> float:
        g = torch.Generator().manual_seed(fit_seed)  # same noise for every s: a smooth fit
        return _selected_coverage(_gumbel_topk(s, z, tokens, k, g), E)

    fit = _fit_scale(coverage, target)
    g = torch.Generator().manual_seed(tensor_seed(seed, prefix + "/skew-rows"))
    chunk = 8192
    table = torch.cat([_gumbel_topk(fit.scale, z, min(chunk, vocab - r), k, g) for r in range(0, vocab, chunk)])
    return table.long(), fit


def skewed_tid2eid(cfg: ModelConfig, layer: int, target: float = SKEW_TARGET, seed: int = 0) -> torch.Tensor:
    """Skewed tid2eid (int64 [vocab, k], CPU) of hash layer `layer`; see `fit_tid2eid`."""
    if not cfg.is_hash_layer(layer):
        raise ValueError(f"layer {layer} is score-routed (no tid2eid); use skewed_gate_bias")
    return fit_tid2eid(cfg, gate_prefix(layer), target=target, seed=seed)[0]


def _gate_prefixes(weights: Mapping[str, torch.Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in weights if n.endswith(".ffn.gate.weight")]


def apply_routing(weights: dict[str, torch.Tensor], cfg: ModelConfig, model: str = "skewed", *, seed: int = 0,
                  target: float = SKEW_TARGET) -> dict[str, SkewFit]:
    """Rewrite, in place, every gate bias (and for `skewed` every tid2eid) in `weights` (main and
    MTP layers) to the routing model `model` (see the module docstring). Tensors keep their dtype
    and device. Returns the fit of each rewritten gate by prefix (empty for default/uniform)."""
    if model not in ROUTING_MODELS:
        raise ValueError(f"routing model must be one of {ROUTING_MODELS}, got {model!r}")
    fits: dict[str, SkewFit] = {}
    if model == "default":
        return fits
    for prefix in _gate_prefixes(weights):
        bias, t2e = prefix + ".bias", prefix + ".tid2eid"
        if bias in weights:
            old = weights[bias]
            if model == "uniform":
                weights[bias] = torch.zeros_like(old)
            else:
                new, fits[prefix] = fit_gate_bias(cfg, weights[prefix + ".weight"], prefix, target=target, seed=seed)
                weights[bias] = new.to(device=old.device, dtype=old.dtype)
        if t2e in weights and model == "skewed":
            old = weights[t2e]
            new, fits[prefix] = fit_tid2eid(cfg, prefix, target=target, seed=seed, vocab=old.shape[0])
            weights[t2e] = new.to(device=old.device, dtype=old.dtype)
    return fits


def apply_skew(weights: dict[str, torch.Tensor], cfg: ModelConfig, seed: int = 0,
               target: float = SKEW_TARGET) -> dict[str, SkewFit]:
    """The skewed routing model as a post-pass over synthetic weights (in place); see apply_routing."""
    return apply_routing(weights, cfg, "skewed", seed=seed, target=target)


def gate_coverage(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, *,
                  tokens: int = CALIBRATION_TOKENS, seed: int = 12345) -> float:
    """Top-25% coverage of layer `layer` measured on a fresh sample: random unit-RMS activations
    through the gate (score layers) or uniform random token ids through tid2eid (hash layers)."""
    prefix = gate_prefix(layer)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if cfg.is_hash_layer(layer):
        t2e = weights[prefix + ".tid2eid"].cpu()
        ids = torch.randint(0, t2e.shape[0], (tokens,), generator=torch.Generator().manual_seed(seed))
        return _selected_coverage(t2e[ids].long(), E)
    scores = _gate_scores(weights[prefix + ".weight"], tokens, seed)
    return _selected_coverage((scores + weights[prefix + ".bias"].cpu().float()).topk(k, dim=-1).indices, E)
