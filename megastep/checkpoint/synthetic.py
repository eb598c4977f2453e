"""Random checkpoints in the official DeepSeek-V4 format: model presets, tensor generation, and a
writer that lays files out like the official Hugging Face repository.

Why random weights: tests, benchmarks and the built-in demo model need checkpoints of any size
without downloading 160 GB. They must exercise every path the real model takes, so the values are
chosen to keep a forward pass healthy at full 43-layer depth (activations O(1), attention and
routing non-degenerate, every zero-initialised parameter of the official code made nonzero).

Reproducibility: each weight is drawn from its own CPU `torch.Generator`, seeded from
(seed, tensor name) with zlib.crc32, so a tensor's bytes depend only on the seed, its name and the
config, never on generation order, sharding or device. Generation always runs on the CPU and the
result is then moved, so a device copy holds exactly the bytes written to disk.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from megastep.checkpoint.formats import (
    MX_BLOCK, dequantize_fp8_weight, dequantize_mxfp4_weight, float_to_e8m0, quantize_fp8_weight,
)
from megastep.checkpoint.tensors import LazyTensors, TensorSpec, expected_tensors
from megastep.config import ModelConfig, QuantConfig
from megastep.errors import CheckpointError, ConfigError
from megastep.tokenizer import MIN_BYTE_VOCAB, write_tokenizer

# ---- presets ----------------------------------------------------------------------------------
PRESETS: dict[str, ModelConfig] = {
    # Every V4 role at toy width: SWA, CSA (ratio 4), HCA (ratio 16), a hash layer, FP8 32x32
    # blocks, MXFP4 experts; the official vocab so the official tokenizer applies.
    "tiny": ModelConfig(
        vocab_size=129280, hidden_size=128, num_hidden_layers=4, compress_ratios=(0, 4, 16, 4, 0),
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2,
        o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        num_hash_layers=1, index_n_heads=8, index_head_dim=32, index_topk=4, sliding_window=16,
        hc_mult=4, hc_sinkhorn_iters=20, quantization_config=QuantConfig(weight_block_size=(32, 32)), expert_dtype="fp4", num_nextn_predict_layers=0,
        max_position_embeddings=4096,
    ),
    # Official head and block geometry (head_dim 512, 128x128 FP8 blocks, ratio 128) at 1/4 width
    # and 6 layers, with one MTP layer.
    "small": ModelConfig(
        vocab_size=129280, hidden_size=1024, num_hidden_layers=6, compress_ratios=(0, 4, 128, 4, 128, 4, 0),
        num_attention_heads=16, head_dim=512, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4,
        o_lora_rank=256, n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=256,
        num_hash_layers=1, index_n_heads=16, index_head_dim=128, index_topk=64, sliding_window=128,
        hc_mult=4, hc_sinkhorn_iters=20, quantization_config=QuantConfig(weight_block_size=(128, 128)),
        expert_dtype="fp4", num_nextn_predict_layers=1,
    ),
    "v4-flash": ModelConfig(),
}


def preset(name: str, layers: int | None = None) -> ModelConfig:
    """A preset config, optionally cut to its first `layers` layers (MTP entries kept)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if layers is None:
        return cfg
    L = cfg.num_hidden_layers
    if not 1 <= layers <= L:
        raise ConfigError(f"preset {name!r} has {L} layers; --layers must be in 1..{L}, got {layers}")
    return cfg.replace(
        num_hidden_layers=layers,
        compress_ratios=cfg.compress_ratios[:layers] + cfg.compress_ratios[L:],
        num_hash_layers=min(cfg.num_hash_layers, layers),
    )


def unquantized_config(cfg: ModelConfig) -> ModelConfig:
    """The same model as a plain BF16 export: no quantization_config, no expert_dtype."""
    return cfg.replace(quantization_config=None, expert_dtype=None)


# ---- values -----------------------------------------------------------------------------------
DTYPE_POLICIES = ("official", "unquantized")
ROUTING_MODELS = ("default", "uniform", "skewed")  # megastep.routing documents them


def tensor_seed(seed: int, name: str) -> int:
    """Seed of one tensor's generator: CRC-32 of "seed/name". 32 bits on purpose: torch's CPU
    generator (mt19937) keeps only the low 32 bits of a seed, so higher bits would be ignored."""
    return zlib.crc32(f"{seed}/{name}".encode())


def _generator(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(tensor_seed(seed, name))


def _randn(shape, g: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device).mul_(std)


def _value(cfg: ModelConfig, name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Unquantized value of one tensor (float32, or int64 for tid2eid)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "attn_sink":
        return _randn(shape, g, 1.0)  # zero would hide the sink path
    if leaf == "ape":
        return _randn(shape, g, 0.2)  # position bias on gate scores of O(1)
    if leaf.startswith("hc_"):
        if leaf.endswith("_fn"):
            # mixes = fn . x * rsqrt(mean x^2): unit-RMS input, so this std is the mixes' std;
            # 0.5 keeps mHC data dependent without letting it swamp the learned base.
            return _randn(shape, g, 0.5 / math.sqrt(shape[1]))
        if leaf.endswith("_base"):
            return _randn(shape, g, 0.5)
        if leaf.endswith("_scale"):
            return 0.5 + torch.rand(shape, generator=g, device=g.device)  # positive, around 1
    if leaf == "bias":  # ffn.gate.bias: selection only, small against scores of O(1)
        return _randn(shape, g, 0.1)
    if leaf == "tid2eid":
        # Each token goes to top-k distinct experts: the k largest of E uniform draws.
        vocab, k = shape
        return torch.rand(vocab, cfg.n_routed_experts, generator=g, device=g.device).topk(k, dim=-1).indices
    if len(shape) == 1 and name.endswith("norm.weight"):
        return 1.0 + _randn(shape, g, 0.05)
    if name == "embed.weight":
        return _randn(shape, g, 1.0)
    if len(shape) == 2:
        # Linear [out, in]: N(0, 1/in) keeps each output O(1) for O(1) inputs; the head then
        # gives logits of std ~1. No extra shrink of the residual-writing projections: measured
        # at 43 layers (reference decode, sims on), sub-layer outputs have RMS 0.4-0.8 and the
        # streams grow from 1 to ~6, so every layer moves the logits; a GPT-2 style
        # 1/sqrt(2 * layers) shrink left each layer a ~5% perturbation of the embedding.
        return _randn(shape, g, 1.0 / math.sqrt(shape[1]))
    raise AssertionError(f"no synthetic value rule for {name} {shape}")


# Mean square of an e2m1 value when the 16 codes are equally likely.
_E2M1_MEAN_SQUARE = 2 * (0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 16


def _mxfp4_weight(shape_packed: tuple[int, int], g: torch.Generator, std: float):
    """Random MXFP4 weight drawn directly as codes (normal draws + quantization cost ~20x more,
    which matters for the 33k expert matrices of V4-Flash): each nibble uniform over the 16 e2m1
    codes; per-block power-of-two scales jittered by 2^{-1,0,1} around the one giving `std`."""
    n, half = shape_packed
    packed = torch.randint(0, 256, (n, half), generator=g, dtype=torch.uint8, device=g.device).view(torch.int8)
    jitter_var = (0.25 + 1 + 4) / 3
    base = round(math.log2(std / math.sqrt(_E2M1_MEAN_SQUARE * jitter_var)))
    exps = base + torch.randint(-1, 2, (n, 2 * half // MX_BLOCK), generator=g, device=g.device)
    return packed, float_to_e8m0(torch.ldexp(torch.ones(exps.shape, device=g.device), exps))


def _official_group(cfg: ModelConfig, table: dict[str, TensorSpec], name: str, seed: int,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensor `name` in its official dtype, plus its `.scale` companion when quantized."""
    spec = table[name]
    g = _generator(seed, name, device)
    prefix = name.removesuffix(".weight")
    scale_name = f"{prefix}.scale"
    if name.endswith(".weight") and scale_name in table:
        if spec.dtype == torch.int8:  # MXFP4, logical [out, 2 * packed]
            w, s = _mxfp4_weight(spec.shape, g, std=1.0 / math.sqrt(2 * spec.shape[1]))
        else:
            w, s = quantize_fp8_weight(_value(cfg, name, spec.shape, g), cfg.fp8_block)
        return {name: w, scale_name: s}
    v = _value(cfg, name, spec.shape, g)
    return {name: v if v.dtype == torch.int64 else v.to(spec.dtype)}


def _unquantize(cfg: ModelConfig, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An official group as the unquantized export stores it: the exact dequantized values in
    BF16 (e4m3/e2m1 times a power of two is always representable), no scale."""
    if len(group) == 1:
        return group
    (wn, w), (_, s) = group.items()
    deq = dequantize_mxfp4_weight(w, s) if w.dtype == torch.int8 else dequantize_fp8_weight(w, s, cfg.fp8_block)
    return {wn: deq.to(torch.bfloat16)}


def _groups(table: dict[str, TensorSpec]) -> list[str]:
    """Names that start a generation group: every tensor except the `.scale` of a weight."""
    return [n for n in table if not (n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in table)]


def _routing_group(cfg: ModelConfig, table: dict[str, TensorSpec], name: str, seed: int, routing: str,
                   group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gate's bias / tid2eid under another routing model (megastep.routing; 'default' keeps the
    draw above). The skewed bias is fitted on the gate weight, regenerated here from its name."""
    if routing == "default" or not (name.endswith(".ffn.gate.bias") or name.endswith(".ffn.gate.tid2eid")):
        return group
    from megastep import routing as rt

    prefix = name.rsplit(".", 1)[0]
    if name.endswith(".bias"):
        if routing == "uniform":
            return {name: torch.zeros_like(group[name])}
        gate = _official_group(cfg, table, prefix + ".weight", seed)[prefix + ".weight"]
        return {name: rt.fit_gate_bias(cfg, gate, prefix, seed=seed)[0].to(group[name].dtype)}
    if routing == "skewed":
        return {name: rt.fit_tid2eid(cfg, prefix, seed=seed, vocab=table[name].shape[0])[0]}
    return group


def synthesize_tensors(cfg: ModelConfig, seed: int, *, include_mtp: bool = True,
                       dtype_policy: str = "official", names: list[str] | None = None,
                       routing: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, one group at a time.

    dtype_policy 'official': the dtypes of expected_tensors(cfg). 'unquantized': the tensors of
    expected_tensors(unquantized_config(cfg)), holding the exact dequantization of the official
    tensors of the same seed (so both checkpoints are the same model). `names` restricts the
    output to the groups whose first tensor is listed (the order of `names` is kept). `routing`
    picks the routing model of the gates (megastep.routing.ROUTING_MODELS: 'default' is the
    N(0, 0.1) bias drawn here, 'uniform' a zero bias, 'skewed' the calibrated benchmark model).
    """
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"dtype_policy must be one of {DTYPE_POLICIES}, got {dtype_policy!r}")
    if routing not in ROUTING_MODELS:
        raise ValueError(f"routing must be one of {ROUTING_MODELS}, got {routing!r}")
    table = expected_tensors(cfg, include_mtp=include_mtp)
    for name in names if names is not None else _groups(table):
        group = _routing_group(cfg, table, name, seed, routing, _official_group(cfg, table, name, seed))
        if dtype_policy == "unquantized":
            group = _unquantize(cfg, group)
        yield from group.items()


def synthesize_weights(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu",
                       include_mtp: bool = True, dtype_policy: str = "official",
                       routing: str = "default") -> dict[str, torch.Tensor]:
    """Every tensor of a random checkpoint for `cfg`, in memory on `device` (generated on the CPU,
    one tensor at a time, then moved: bytes are identical on every device)."""
    return {n: t.to(device) for n, t in synthesize_tensors(cfg, seed, include_mtp=include_mtp,
                                                            dtype_policy=dtype_policy, routing=routing)}


def synthesize_on_device(cfg: ModelConfig, seed: int, device: str | torch.device,
                         include_mtp: bool = False, routing: str = "default") -> dict[str, torch.Tensor]:
    """The official-format weights generated directly in `device` memory, for full-geometry
    benchmarks larger than the disk (and than a CPU could draw in reasonable time). Same value
    rules and formats as `synthesize_weights`; the values differ from it because each device's
    random generator is its own, but they are reproducible from the seed on a given device.
    `routing` as in synthesize_tensors (the skewed fit runs on the CPU from the device's gates)."""
    if routing not in ROUTING_MODELS:
        raise ValueError(f"routing must be one of {ROUTING_MODELS}, got {routing!r}")
    table = expected_tensors(cfg, include_mtp=include_mtp)
    out: dict[str, torch.Tensor] = {}
    for name in _groups(table):
        out.update(_official_group(cfg, table, name, seed, device))
    if routing != "default":
        from megastep.routing import apply_routing

        apply_routing(out, cfg, routing, seed=seed)
    return out


class LazyDeviceWeights(LazyTensors):
    """`synthesize_on_device` one group at a time, on first access: a mapping whose tensors are
    generated in `device` memory when read, so a consumer that builds a layer and then deletes
    that layer's names (FastDecoder with consume=True) never holds more than about one layer of
    raw weights. This is how a full-geometry model larger than HBM (V4-Flash, with its cold
    experts moved to host memory at build) is generated on one GPU. Values equal
    `synthesize_on_device`'s for the same seed, device and routing; names are those of the
    official tensor table (MTP excluded)."""

    def __init__(self, cfg: ModelConfig, seed: int, device: str | torch.device, routing: str = "default"):
        if routing not in ROUTING_MODELS:
            raise ValueError(f"routing must be one of {ROUTING_MODELS}, got {routing!r}")
        self.cfg, self.seed, self.device, self.routing = cfg, seed, torch.device(device), routing
        self.table = expected_tensors(cfg, include_mtp=False)
        super().__init__(self.table)
        self._cache: dict[str, torch.Tensor] = {}  # a generated group's tensors, until deleted

    def nbytes(self) -> dict[str, int]:
        """Bytes of every tensor (of the table: generated or not)."""
        return {n: s.nbytes for n, s in self.table.items()}

    def _group_name(self, name: str) -> str:
        base = name.removesuffix(".scale")
        return base + ".weight" if base != name and base + ".weight" in self.table else name

    def _read(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            group = _official_group(self.cfg, self.table, self._group_name(name), self.seed, self.device)
            if self.routing != "default" and (name.endswith(".ffn.gate.bias") or name.endswith(".ffn.gate.tid2eid")):
                from megastep.routing import apply_routing

                gate = name.rsplit(".", 1)[0] + ".weight"
                group[gate] = self[gate]
                apply_routing(group, self.cfg, self.routing, seed=self.seed)
                del group[gate]
            self._cache.update(group)
        return self._cache[name]

    def _forget(self, name: str) -> None:
        self._cache.pop(name, None)


# ---- writing a checkpoint directory -------------------------------------------------------------
DEFAULT_SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size ("5GB")
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class WrittenCheckpoint:
    path: Path
    num_tensors: int
    total_bytes: int
    shards: list[str]
    tokenizer: str | None
    notes: list[str] = field(default_factory=list)


def plan_shards(group_bytes: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Split groups (kept whole, in order) into shards of at most shard_bytes (a single group
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in group_bytes:
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int, *,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, unquantized: bool = False,
                     tokenizer: str = "auto", include_mtp: bool = True, overwrite: bool = False,
                     progress: bool = False, routing: str = "default") -> WrittenCheckpoint:
    """Write config.json, model-0000i-of-0000N.safetensors shards, model.safetensors.index.json
    and tokenizer files into out_dir, exactly as the official HF repository lays them out.

    Tensors are generated shard by shard, so at most one shard sits in memory. `unquantized`
    writes the BF16 export of the same model (no quantization_config, no scales). `routing`
    picks the gates' routing model (see synthesize_tensors).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if not overwrite and any((out / n).exists() for n in ("config.json", INDEX_FILE, "model.safetensors")):
        raise CheckpointError(f"{out} already holds a checkpoint (pass overwrite to replace it)")
    file_cfg = unquantized_config(cfg) if unquantized else cfg
    policy = "unquantized" if unquantized else "official"
    official = expected_tensors(cfg, include_mtp=include_mtp)
    stored = expected_tensors(file_cfg, include_mtp=include_mtp)
    groups = _groups(official)
    # Bytes of each group as stored: the weight, plus its scale where the stored table has one.
    sizes = [(n, stored[n].nbytes + (stored[s].nbytes if (s := n.removesuffix(".weight") + ".scale") in stored
                                     and n.endswith(".weight") else 0)) for n in groups]
    shards = plan_shards(sizes, shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(s for _, s in sizes), unit="B", unit_scale=True, desc="writing")
    weight_map: dict[str, str] = {}
    for fname, shard in zip(files, shards):
        tensors = dict(synthesize_tensors(cfg, seed, include_mtp=include_mtp, dtype_policy=policy, names=shard,
                                          routing=routing))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors creates files owner-only; shards are shareable data
        weight_map.update(dict.fromkeys(tensors, fname))
        if bar is not None:
            bar.update(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors
    if bar is not None:
        bar.close()

    total = sum(stored[n].nbytes for n in weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(file_cfg.to_dict(), indent=2) + "\n")

    kind = write_tokenizer(file_cfg, out, tokenizer)
    notes = []
    if kind is None and tokenizer == "auto":
        notes.append(f"no tokenizer written: vocab_size {cfg.vocab_size} is below {MIN_BYTE_VOCAB} "
                     "(256 byte tokens + BOS + EOS + 1); such a model takes token ids only")
    return WrittenCheckpoint(out, len(weight_map), total, files, kind, notes)
