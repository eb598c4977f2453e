"""Official `config.json` -> frozen, typed `ModelConfig`.

Only DeepSeek-V4 (`model_type: deepseek_v4`, e.g. DeepSeek-V4-Flash) runs today. A V4.1 config
(`deepseek_v41`) parses far enough to be recognised and is refused with a clear message; any other
model type is refused too. Field names follow the official config.json, so `to_dict()` writes a
file that the official code, transformers and megastep all read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from megastep.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
KNOWN_UNSUPPORTED = {"deepseek_v41": "DeepSeek-V4.1 (deepseek_v41) is not supported yet"}

# Attention kinds by compress ratio: 0 = sliding window only; 4 = CSA (overlapping compressor +
# Lightning Indexer); any other ratio = HCA (non-overlapping compressor, all entries attended).
CSA_RATIO = 4


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters, applied only on layers with a compressor (ratio > 0)."""

    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's `quantization_config`: FP8 e4m3 weights with power-of-two block scales."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    # One entry per layer plus one per MTP layer (the official file lists both).
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    quantization_config: QuantConfig | None = field(default_factory=QuantConfig)
    expert_dtype: str | None = "fp4"

    # ---- derived facts -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def fp8_block(self) -> int:
        """Block edge of FP8 weight scales and of activation quantization before FP8 linears."""
        assert self.quantization_config is not None
        return self.quantization_config.weight_block_size[0]

    @property
    def act_block(self) -> int:
        """Channels per activation-quantization block before a quantized linear."""
        return self.quantization_config.weight_block_size[1] if self.quantization_config else 128

    @property
    def fp8_weights(self) -> bool:
        return self.quantization_config is not None

    @property
    def fp4_experts(self) -> bool:
        return self.quantization_config is not None and self.expert_dtype == "fp4"

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """'sliding', 'csa' or 'hca'."""
        r = self.ratio(layer)
        return "sliding" if r == 0 else ("csa" if r == CSA_RATIO else "hca")

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    # ---- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, check_supported: bool = True) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        model_type = d.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type'")
        if check_supported and model_type not in SUPPORTED_MODEL_TYPES:
            if model_type in KNOWN_UNSUPPORTED:
                raise ConfigError(f"{KNOWN_UNSUPPORTED[model_type]}; megastep runs {', '.join(SUPPORTED_MODEL_TYPES)}")
            raise ConfigError(f"unknown model_type {model_type!r}; megastep runs {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "deepseek_v41" and "text_config" in d:
            d = {**d["text_config"], "model_type": model_type, **{k: v for k, v in d.items() if k == "quantization_config"}}
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k not in known:
                continue  # architectures, torch_dtype, hidden_act, ... carry nothing megastep needs
            kw[k] = v
        try:
            if "rope_scaling" in kw and kw["rope_scaling"] is not None:
                rs = dict(kw["rope_scaling"])
                rs["type"] = rs.pop("type", rs.pop("rope_type", "yarn"))
                kw["rope_scaling"] = RopeScaling(**{k: v for k, v in rs.items() if k in {f.name for f in fields(RopeScaling)}})
            if "quantization_config" in kw and kw["quantization_config"] is not None:
                qc = dict(kw["quantization_config"])
                if "expert_dtype" in qc and "expert_dtype" not in d:
                    kw["expert_dtype"] = qc["expert_dtype"]
                qk = {f.name for f in fields(QuantConfig)}
                qc = {k: v for k, v in qc.items() if k in qk}
                if "weight_block_size" in qc:
                    qc["weight_block_size"] = tuple(int(x) for x in qc["weight_block_size"])
                kw["quantization_config"] = QuantConfig(**qc)
            elif "quantization_config" not in d:
                kw["quantization_config"] = None
                kw.setdefault("expert_dtype", None)
            if isinstance(kw.get("eos_token_id"), list):
                kw["eos_token_id"] = int(kw["eos_token_id"][0])
            if "compress_ratios" in kw:
                kw["compress_ratios"] = tuple(int(r) for r in kw["compress_ratios"])
            elif "num_hidden_layers" in kw:
                raise ConfigError("config.json has no 'compress_ratios' (one entry per layer)")
            cfg = cls(**kw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json: {e}") from None
        if check_supported:
            cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        if self.quantization_config is None:
            del d["quantization_config"]
            del d["expert_dtype"]
        else:
            d["quantization_config"]["weight_block_size"] = list(self.quantization_config.weight_block_size)
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "bfloat16"
        return d

    def replace(self, **kw: Any) -> "ModelConfig":
        return replace(self, **kw)

    def validate(self) -> None:
        """Reject configs that the decode math cannot run, with every reason in one message."""
        p: list[str] = []
        L = self.num_hidden_layers
        if len(self.compress_ratios) < L:
            p.append(f"compress_ratios has {len(self.compress_ratios)} entries for {L} layers")
        elif any(r < 0 for r in self.compress_ratios[:L]):
            p.append("compress_ratios must be >= 0")
        if self.num_key_value_heads != 1:
            p.append("num_key_value_heads must be 1 (shared K=V head)")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            p.append("qk_rope_head_dim must be even and <= head_dim")
        if self.num_attention_heads % self.o_groups:
            p.append("num_attention_heads must be a multiple of o_groups")
        if self.num_experts_per_tok > self.n_routed_experts:
            p.append("num_experts_per_tok exceeds n_routed_experts")
        if self.scoring_func != "sqrtsoftplus":
            p.append(f"scoring_func {self.scoring_func!r} is not supported (only sqrtsoftplus)")
        if self.n_shared_experts != 1:
            p.append("n_shared_experts must be 1")
        if self.index_head_dim & (self.index_head_dim - 1):
            p.append("index_head_dim must be a power of two (Hadamard rotation)")
        if self.rope_scaling is not None and self.rope_scaling.type != "yarn":
            p.append(f"rope_scaling type {self.rope_scaling.type!r} is not supported (only yarn)")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            p.append("hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.quantization_config is not None:
            q = self.quantization_config
            if q.quant_method != "fp8" or q.fmt != "e4m3":
                p.append(f"quantization {q.quant_method}/{q.fmt} is not supported (only fp8/e4m3)")
            if q.weight_block_size[0] != q.weight_block_size[1]:
                p.append("weight_block_size must be square")
            if self.expert_dtype not in (None, "fp4", "fp8"):
                p.append(f"expert_dtype {self.expert_dtype!r} is not supported")
            if self.expert_dtype == "fp4" and (self.hidden_size % 32 or self.moe_intermediate_size % 32):
                p.append("fp4 experts need hidden_size and moe_intermediate_size divisible by 32")
        if p:
            raise ConfigError("config.json describes a model megastep cannot run:\n  - " + "\n  - ".join(p))

    # ---- sizes used by `inspect`, the planner and the state pool -------------------------
    def state_bytes_per_token(self) -> float:
        """Bytes of per-sequence state that grow with context, per token (reference layout:
        compressed KV in bf16, index keys in bf16)."""
        b = 0.0
        for L in range(self.num_hidden_layers):
            r = self.ratio(L)
            if r:
                b += self.head_dim * 2 / r
                if r == CSA_RATIO:
                    b += self.index_head_dim * 2 / r
        return b

    def state_bytes_fixed(self) -> int:
        """Bytes of per-sequence state that do not grow: window rings and compressor buffers."""
        b = 0
        for L in range(self.num_hidden_layers):
            r = self.ratio(L)
            b += self.sliding_window * self.head_dim * 2
            if r == CSA_RATIO:
                b += 2 * (2 * r) * (2 * self.head_dim) * 4 + 2 * (2 * r) * (2 * self.index_head_dim) * 4
            elif r:
                b += 2 * r * self.head_dim * 4
        return b


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
