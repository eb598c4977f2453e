"""The official DeepSeek-V4 tensor table (MODEL_SPEC §2.1, §2.2), derived from a `ModelConfig`,
and the check of a checkpoint's tensors against it.

Every name, dtype and shape here is what the official checkpoint stores: megastep loads it as
published, so the table is the contract between `synthetic.py` (writes it), `loader.py` (checks
and reads it) and the model code (consumes it). Names follow the official `inference/model.py`
module tree (`layers.L.attn.wq_a.weight`, ...), not the transformers renames (§2.4).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from collections.abc import MutableMapping
from typing import Iterable, Mapping

import torch

from megastep.config import ModelConfig, ceil_div
from megastep.checkpoint.formats import MX_BLOCK
from megastep.errors import CheckpointError

# safetensors header dtype names <-> torch dtypes (only those a V4 checkpoint may hold, plus the
# common ones so that a wrong dtype is reported by its name rather than as "unknown").
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64
FP8, E8M0, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8

ROLES = ("embed", "head", "norm", "mhc", "attention", "compressor", "indexer", "router",
         "routed_expert", "shared_expert", "mtp")

# How many names of one kind of problem an error message lists before it says "and N more".
LIST_CAP = 20


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its dtype and shape as stored, and what it is for.

    `also_accepts` lists other dtypes a valid checkpoint may use for it (an unquantized export
    written in float32 by transformers; F32 scales of FP8-expert checkpoints).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    role: str
    also_accepts: tuple[torch.dtype, ...] = ()

    def accepts(self, dtype: torch.dtype | str) -> bool:
        return dtype == self.dtype or dtype in self.also_accepts

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        alt = "".join(f"|{dtype_name(d)}" for d in self.also_accepts)
        return f"{dtype_name(self.dtype)}{alt} {list(self.shape)}"


class _Table:
    """Builds the ordered name -> TensorSpec map for one config."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.quantized = cfg.quantization_config is not None
        # An unquantized export (transformers, fp32 or bf16) may store every floating-point
        # tensor that the official checkpoint keeps in BF16/FP8/FP4 as float32 instead.
        self.wide: tuple[torch.dtype, ...] = () if self.quantized else (F32,)
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], role: str,
            also: tuple[torch.dtype, ...] = ()) -> None:
        self.specs[name] = TensorSpec(dtype, tuple(map(int, shape)), role, also)

    def bf16(self, name: str, shape: tuple[int, ...], role: str) -> None:
        self.add(name, BF16, shape, role, self.wide)

    def linear(self, prefix: str, out: int, inp: int, role: str, fmt: str = "fp8") -> None:
        """`prefix.weight` [out, in] plus `prefix.scale` when quantized. fmt: 'fp8' or 'fp4'."""
        if not self.quantized:
            self.bf16(f"{prefix}.weight", (out, inp), role)
            return
        if fmt == "fp4":
            self.add(f"{prefix}.weight", I8, (out, inp // 2), role)
            self.add(f"{prefix}.scale", E8M0, (out, inp // MX_BLOCK), role)
            return
        b = self.cfg.fp8_block
        # DeepSeek-V4-Flash-Base (FP8 experts) stores its ue8m0 scales as F32 (MODEL_SPEC §2.1).
        scale_alt = (F32,) if self.cfg.expert_dtype == "fp8" else ()
        self.add(f"{prefix}.weight", FP8, (out, inp), role)
        self.add(f"{prefix}.scale", E8M0, (ceil_div(out, b), ceil_div(inp, b)), role, scale_alt)

    # ---- pieces ------------------------------------------------------------------------
    def hc_head(self, prefix: str, role: str) -> None:
        c = self.cfg
        self.add(f"{prefix}hc_head_fn", F32, (c.hc_mult, c.hc_mult * c.hidden_size), role)
        self.add(f"{prefix}hc_head_base", F32, (c.hc_mult,), role)
        self.add(f"{prefix}hc_head_scale", F32, (1,), role)

    def compressor(self, prefix: str, ratio: int, head_dim: int, role: str) -> None:
        # Ratio 4 (CSA) compresses overlapping windows: two halves [Ca | Cb], hence 2*head_dim.
        width = 2 * head_dim if ratio == 4 else head_dim
        D = self.cfg.hidden_size
        self.bf16(f"{prefix}.wkv.weight", (width, D), role)
        self.bf16(f"{prefix}.wgate.weight", (width, D), role)
        self.add(f"{prefix}.ape", F32, (ratio, width), role)
        self.bf16(f"{prefix}.norm.weight", (head_dim,), role)

    def block(self, p: str, ratio: int, hash_layer: bool) -> None:
        c = self.cfg
        D, H, hd = c.hidden_size, c.num_attention_heads, c.head_dim
        self.bf16(f"{p}attn_norm.weight", (D,), "norm")
        self.bf16(f"{p}ffn_norm.weight", (D,), "norm")
        for sub in ("attn", "ffn"):
            self.add(f"{p}hc_{sub}_fn", F32, (c.mix_hc, c.hc_mult * D), "mhc")
            self.add(f"{p}hc_{sub}_base", F32, (c.mix_hc,), "mhc")
            self.add(f"{p}hc_{sub}_scale", F32, (3,), "mhc")

        a = f"{p}attn."
        self.add(f"{a}attn_sink", F32, (H,), "attention")
        self.linear(f"{a}wq_a", c.q_lora_rank, D, "attention")
        self.bf16(f"{a}q_norm.weight", (c.q_lora_rank,), "attention")
        self.linear(f"{a}wq_b", H * hd, c.q_lora_rank, "attention")
        self.linear(f"{a}wkv", hd, D, "attention")
        self.bf16(f"{a}kv_norm.weight", (hd,), "attention")
        self.linear(f"{a}wo_a", c.o_groups * c.o_lora_rank, H * hd // c.o_groups, "attention")
        self.linear(f"{a}wo_b", D, c.o_groups * c.o_lora_rank, "attention")
        if ratio:
            self.compressor(f"{a}compressor", ratio, hd, "compressor")
        if ratio == 4:
            ih = c.index_n_heads
            self.linear(f"{a}indexer.wq_b", ih * c.index_head_dim, c.q_lora_rank, "indexer")
            self.bf16(f"{a}indexer.weights_proj.weight", (ih, D), "indexer")
            self.compressor(f"{a}indexer.compressor", ratio, c.index_head_dim, "indexer")

        f = f"{p}ffn."
        E, I = c.n_routed_experts, c.moe_intermediate_size
        self.bf16(f"{f}gate.weight", (E, D), "router")
        if hash_layer:
            self.add(f"{f}gate.tid2eid", I64, (c.vocab_size, c.num_experts_per_tok), "router")
        else:
            self.add(f"{f}gate.bias", F32, (E,), "router")
        efmt = "fp4" if c.expert_dtype == "fp4" else "fp8"
        for e in range(E):
            self.linear(f"{f}experts.{e}.w1", I, D, "routed_expert", efmt)
            self.linear(f"{f}experts.{e}.w2", D, I, "routed_expert", efmt)
            self.linear(f"{f}experts.{e}.w3", I, D, "routed_expert", efmt)
        self.linear(f"{f}shared_experts.w1", I, D, "shared_expert")
        self.linear(f"{f}shared_experts.w2", D, I, "shared_expert")
        self.linear(f"{f}shared_experts.w3", I, D, "shared_expert")


def mtp_ratio(cfg: ModelConfig, i: int) -> int:
    """Compress ratio of MTP layer i: the entry after the main layers (0 if the config omits it)."""
    k = cfg.num_hidden_layers + i
    return cfg.compress_ratios[k] if k < len(cfg.compress_ratios) else 0


def expected_tensors(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint for `cfg`, in checkpoint order (embed, layers,
    final norm/head/hc_head, then MTP). A fresh dict per call; the table itself is cached."""
    return dict(_expected_tensors(cfg, include_mtp))


@functools.lru_cache(maxsize=8)  # V4-Flash has 69k tensors: building the table takes ~0.3 s
def _expected_tensors(cfg: ModelConfig, include_mtp: bool) -> dict[str, TensorSpec]:
    t = _Table(cfg)
    D = cfg.hidden_size
    t.bf16("embed.weight", (cfg.vocab_size, D), "embed")
    for L in range(cfg.num_hidden_layers):
        t.block(f"layers.{L}.", cfg.ratio(L), cfg.is_hash_layer(L))
    t.bf16("norm.weight", (D,), "norm")
    t.bf16("head.weight", (cfg.vocab_size, D), "head")
    t.hc_head("", "mhc")
    if include_mtp:
        for i in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{i}."
            # The MTP block is an ordinary block (never hash-routed: its layer id is past
            # num_hash_layers) plus the projections that feed it the main model's state.
            t.block(p, mtp_ratio(cfg, i), hash_layer=False)
            t.linear(f"{p}e_proj", D, D, "mtp")
            t.linear(f"{p}h_proj", D, D, "mtp")
            for n in ("enorm", "hnorm", "norm"):
                t.bf16(f"{p}{n}.weight", (D,), "mtp")
            t.hc_head(p, "mtp")
    return t.specs


# ---- validation -------------------------------------------------------------------------
Found = Mapping[str, tuple[torch.dtype | str, Iterable[int]]]
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def _listing(title: str, items: list[str]) -> str:
    shown = items[:LIST_CAP]
    more = f"\n      ... and {len(items) - LIST_CAP} more" if len(items) > LIST_CAP else ""
    return f"{title} ({len(items)}):\n      " + "\n      ".join(shown) + more


def _as_dtype(d: torch.dtype | str) -> torch.dtype | str:
    return SAFETENSORS_DTYPES.get(d, d) if isinstance(d, str) else d


def _config_hints(cfg: ModelConfig, found: Found, expected: dict[str, TensorSpec]) -> list[str]:
    """Say plainly when config.json and the tensors describe different models, since a wrong
    config otherwise shows up only as hundreds of shape errors."""
    hints = []
    if "embed.weight" in found:
        shape = list(found["embed.weight"][1])
        if shape != [cfg.vocab_size, cfg.hidden_size]:
            hints.append(f"embed.weight is {shape} but config.json says vocab_size {cfg.vocab_size}, "
                         f"hidden_size {cfg.hidden_size}")
    layers = {int(m.group(1)) for n in found if (m := _LAYER_RE.match(n))}
    if layers and max(layers) + 1 != cfg.num_hidden_layers:
        hints.append(f"the tensors hold {max(layers) + 1} layers but config.json says "
                     f"num_hidden_layers {cfg.num_hidden_layers}")
    fp8_found = any(_as_dtype(d) == FP8 for d, _ in found.values())
    if fp8_found and cfg.quantization_config is None:
        hints.append("the tensors are FP8-quantized but config.json has no quantization_config")
    elif not fp8_found and found and cfg.quantization_config is not None:
        hints.append("the tensors hold no FP8 weights but config.json has a quantization_config")
    common = [n for n in expected if n in found]
    bad = sum(list(found[n][1]) != list(expected[n].shape) for n in common)
    if common and bad * 2 > len(common) and not hints:
        hints.append(f"{bad} of {len(common)} tensors have other shapes than config.json implies")
    if hints:
        return ["config.json does not match the tensors (edited, or from another model?): "
                + "; ".join(hints)]
    return []


def find_problems(cfg: ModelConfig, found: Found, shards_missing: Iterable[str] = (), *,
                  require_mtp: bool = True, unreadable: Iterable[str] = ()) -> list[str]:
    """Every way `found` (name -> (dtype, shape) as in the shard headers) differs from the
    official table for `cfg`, one string per kind of problem.

    MTP tensors are always checked when present; with `require_mtp=False` a checkpoint that has
    none at all is fine (MTP is optional for plain decoding). `unreadable` names tensors that the
    index places in missing or corrupt shards: they are counted, not listed one by one.
    """
    problems: list[str] = []
    shards_missing = list(shards_missing)
    if shards_missing:
        problems.append(_listing("shards listed in model.safetensors.index.json but absent",
                                 shards_missing))
    has_mtp = any(n.startswith("mtp.") for n in found)
    expected = expected_tensors(cfg, include_mtp=require_mtp or has_mtp)
    problems += _config_hints(cfg, found, expected)
    unreadable = set(unreadable)
    missing = [f"{n}  ({s.describe()})" for n, s in expected.items()
               if n not in found and n not in unreadable]
    if missing:
        problems.append(_listing("missing tensors", missing))
    lost = sum(1 for n in expected if n not in found and n in unreadable)
    if lost:
        problems.append(f"{lost} tensors cannot be checked: their shards are missing or unreadable")
    unexpected = [f"{n}  ({dtype_name(_as_dtype(d))} {list(s)})" for n, (d, s) in found.items()
                  if n not in expected]
    if unexpected:
        problems.append(_listing("unexpected tensors", unexpected))
    wrong_dtype, wrong_shape = [], []
    for n, (d, shape) in found.items():
        spec = expected.get(n)
        if spec is None:
            continue
        d = _as_dtype(d)
        if not spec.accepts(d):
            wrong_dtype.append(f"{n} is {dtype_name(d)}, expected {spec.describe().split(' ')[0]}")
        if list(shape) != list(spec.shape):
            wrong_shape.append(f"{n} is {list(shape)}, expected {list(spec.shape)}")
    if wrong_dtype:
        problems.append(_listing("tensors with the wrong dtype", wrong_dtype))
    if wrong_shape:
        problems.append(_listing("tensors with the wrong shape", wrong_shape))
    return problems


def format_problems(where: str, problems: list[str]) -> str:
    n = len(problems)
    return f"{where}: {n} problem{'s' if n > 1 else ''}:\n  - " + "\n  - ".join(problems)


def validate(cfg: ModelConfig, found: Found, shards_missing: Iterable[str] = (), *,
             require_mtp: bool = True, unreadable: Iterable[str] = (),
             where: str = "checkpoint does not match its config.json") -> None:
    """Raise one CheckpointError listing every problem `find_problems` sees; return if none."""
    problems = find_problems(cfg, found, shards_missing, require_mtp=require_mtp,
                             unreadable=unreadable)
    if problems:
        raise CheckpointError(format_problems(where, problems))


class LazyTensors(MutableMapping):
    """Named tensors produced on first access (`_read`, in the subclass): a checkpoint read shard by
    shard, synthetic weights generated group by group. Deleting a name forgets it, so a consumer
    that deletes each layer's names once the layer is built (FastDecoder with consume=True) holds
    about one layer of raw tensors at a time. Read-only otherwise."""

    def __init__(self, names: Iterable[str]):
        self._names = dict.fromkeys(names)  # ordered set of the names not yet deleted

    def _read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _forget(self, name: str) -> None:
        """Drop whatever the subclass keeps for `name`."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        raise TypeError(f"{type(self).__name__} is read-only")

    def __delitem__(self, name: str) -> None:
        del self._names[name]
        self._forget(name)

    def __iter__(self):
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)
