"""Synthetic official-format checkpoints: presets, reproducible values, the on-disk layout."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from megastep.checkpoint.formats import (
    dequantize_fp8_weight, dequantize_mxfp4_weight, e2m1_to_float, e8m0_to_float,
    quantize_mxfp4_weight, unpack_fp4,
)
from megastep.checkpoint.synthetic import (
    PRESETS, LazyDeviceWeights, preset, synthesize_on_device, synthesize_tensors, synthesize_weights, unquantized_config, write_checkpoint,
)
from megastep.checkpoint.tensors import expected_tensors
from megastep.config import ModelConfig
from megastep.errors import ConfigError
from megastep.tokenizer import load_tokenizer

# Every V4 role (SWA, CSA, HCA, hash and score routing, FP8 32x32, MXFP4 experts, MTP) at a size
# that generates in milliseconds.
MICRO = preset("tiny", layers=3).replace(vocab_size=512, num_nextn_predict_layers=1)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, for exact comparison whatever its dtype (float8 has no torch.equal)."""
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.fixture(scope="module")
def micro_weights():
    return synthesize_weights(MICRO, seed=0)


def test_presets():
    assert PRESETS["v4-flash"] == ModelConfig()
    tiny = preset("tiny")
    assert tiny.compress_ratios == (0, 4, 16, 4, 0) and tiny.fp8_block == 32 and tiny.expert_dtype == "fp4"
    assert [tiny.layer_kind(i) for i in range(4)] == ["sliding", "csa", "hca", "csa"]
    small = preset("small")
    assert small.num_nextn_predict_layers == 1 and len(small.compress_ratios) == 7
    cut = preset("v4-flash", layers=5)
    assert cut.num_hidden_layers == 5 and cut.compress_ratios == (0, 0, 4, 128, 4, 0)
    assert preset("tiny", layers=1).num_hash_layers == 1
    for cfg in PRESETS.values():
        cfg.validate()
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="1..4"):
        preset("tiny", layers=9)


def test_official_dtypes_and_shapes(micro_weights):
    table = expected_tensors(MICRO)
    assert list(micro_weights) == list(table)
    for name, spec in table.items():
        t = micro_weights[name]
        assert (t.dtype, tuple(t.shape)) == (spec.dtype, spec.shape), name


def test_same_seed_same_bytes_other_seed_other_bytes(micro_weights):
    again = synthesize_weights(MICRO, seed=0)
    other = synthesize_weights(MICRO, seed=1)
    for name, t in micro_weights.items():
        assert same_bytes(t, again[name]), name
        if t.dtype == torch.float8_e8m0fnu and micro_weights[name[:-6] + ".weight"].dtype != torch.int8:
            continue  # FP8 block scales follow from the weight's std: equal across seeds
        assert not same_bytes(t, other[name]), name


def test_values_do_not_depend_on_generation_order(micro_weights):
    names = ["layers.2.attn.compressor.ape", "layers.1.ffn.experts.3.w2.weight", "embed.weight"]
    got = dict(synthesize_tensors(MICRO, 0, names=names))
    for n in got:
        assert same_bytes(got[n], micro_weights[n]), n
    assert "layers.1.ffn.experts.3.w2.scale" in got  # a weight comes with its scale


def test_values_are_non_degenerate(micro_weights):
    w = micro_weights
    for L in range(3):
        p = f"layers.{L}."
        assert (w[p + "attn.attn_sink"] != 0).all()
        assert (w[p + "hc_attn_base"] != 0).all() and (w[p + "hc_ffn_scale"] > 0).all()
        norm = w[p + "attn_norm.weight"].float()
        assert (norm - 1).abs().max() < 0.5 and norm.std() > 0
    assert (w["layers.1.attn.compressor.ape"] != 0).all()
    assert (w["layers.1.attn.indexer.compressor.ape"] != 0).all()
    assert (w["layers.1.ffn.gate.bias"] != 0).all()
    assert (w["hc_head_scale"] > 0).all() and (w["mtp.0.hc_head_scale"] > 0).all()
    # A linear's dequantized weight has std ~ 1/sqrt(fan_in).
    wq = dequantize_fp8_weight(w["layers.0.attn.wq_a.weight"], w["layers.0.attn.wq_a.scale"], 32)
    assert 0.7 < wq.std().item() * 128**0.5 < 1.3
    w1 = dequantize_mxfp4_weight(w["layers.1.ffn.experts.0.w1.weight"], w["layers.1.ffn.experts.0.w1.scale"])
    assert 0.5 < w1.std().item() * 128**0.5 < 2.0


def test_tid2eid_rows_distinct_experts(micro_weights):
    t = micro_weights["layers.0.ffn.gate.tid2eid"]
    assert t.dtype == torch.int64 and t.shape == (512, 2)
    assert (t >= 0).all() and (t < MICRO.n_routed_experts).all()
    assert (t[:, 0] != t[:, 1]).all()
    assert len(torch.unique(t[:, 0])) == MICRO.n_routed_experts  # every expert gets used
    big = next(v for n, v in synthesize_tensors(preset("tiny", layers=1).replace(vocab_size=300, n_routed_experts=32,
                                                num_experts_per_tok=6), 3, names=["layers.0.ffn.gate.tid2eid"]))
    assert all(len(set(row.tolist())) == 6 for row in big)


def test_mxfp4_packing_round_trip(micro_weights):
    packed = micro_weights["layers.2.ffn.experts.5.w3.weight"]
    scale = micro_weights["layers.2.ffn.experts.5.w3.scale"]
    assert packed.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
    w = dequantize_mxfp4_weight(packed, scale)
    # Low nibble holds the even (first) element of each pair.
    u = packed.view(torch.uint8)
    s = e8m0_to_float(scale).repeat_interleave(32, -1)
    assert torch.equal(w[:, 0::2], e2m1_to_float(u & 0xF) * s[:, 0::2])
    assert torch.equal(w[:, 1::2], e2m1_to_float(u >> 4) * s[:, 1::2])
    assert torch.equal(unpack_fp4(packed)[:, 0::2], u & 0xF)
    # Re-quantizing the dequantized weight gives back the same values.
    assert torch.equal(dequantize_mxfp4_weight(*quantize_mxfp4_weight(w)), w)


def test_unquantized_policy_is_the_same_model(micro_weights):
    unq = synthesize_weights(MICRO, 0, dtype_policy="unquantized")
    table = expected_tensors(unquantized_config(MICRO))
    assert list(unq) == list(table)
    for name, spec in table.items():
        assert (unq[name].dtype, tuple(unq[name].shape)) == (spec.dtype, spec.shape), name
    w = micro_weights
    p = "layers.1.attn.wkv"
    assert torch.equal(unq[p + ".weight"].float(), dequantize_fp8_weight(w[p + ".weight"], w[p + ".scale"], 32))
    p = "layers.1.ffn.experts.2.w2"
    assert torch.equal(unq[p + ".weight"].float(), dequantize_mxfp4_weight(w[p + ".weight"], w[p + ".scale"]))
    assert same_bytes(unq["layers.0.attn.attn_sink"], w["layers.0.attn.attn_sink"])
    with pytest.raises(ValueError, match="dtype_policy"):
        synthesize_weights(MICRO, 0, dtype_policy="fp16")


def test_written_checkpoint_layout(tmp_path):
    out = write_checkpoint(MICRO, tmp_path / "ck", seed=7, shard_bytes=200_000)
    d = out.path
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(MICRO))
    assert len(out.shards) > 1 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(out.shards):05d}\.safetensors", s)
                                       for s in out.shards)
    assert sorted(set(index["weight_map"].values())) == out.shards
    total = 0
    for shard in out.shards:
        with safe_open(str(d / shard), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total == out.total_bytes
    assert ModelConfig.from_json(d / "config.json") == MICRO
    # vocab 512: a byte-level tokenizer with BOS/EOS at the config's ids.
    tok = load_tokenizer(d)
    assert out.tokenizer == "bytes" and (tok.bos_id, tok.eos_id) == (0, 1) and tok.vocab_size == 512
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"


def test_written_unquantized_checkpoint(tmp_path):
    out = write_checkpoint(MICRO.replace(vocab_size=200), tmp_path / "u", seed=0, unquantized=True)
    raw_cfg = json.loads((out.path / "config.json").read_text())
    assert "quantization_config" not in raw_cfg
    assert ModelConfig.from_dict(raw_cfg).quantization_config is None
    assert out.tokenizer is None and "no tokenizer" in out.notes[0]
    with safe_open(str(out.path / out.shards[0]), "pt") as f:
        assert not [k for k in f.keys() if k.endswith(".scale")]


def test_forward_pass_is_healthy_at_full_depth():
    """43 layers in the official CSA/HCA pattern (narrow, so it runs on a CPU): logits finite,
    of std ~1, varied, and a layer near the top still moves them."""
    from megastep.config import QuantConfig
    from megastep.model.reference import ReferenceModel

    cfg = ModelConfig().replace(
        vocab_size=1024, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=8, moe_intermediate_size=64,
        index_n_heads=8, index_head_dim=32, index_topk=4, sliding_window=8, num_nextn_predict_layers=0,
        compress_ratios=(0, 0) + (4, 8) * 20 + (4, 0), quantization_config=QuantConfig(weight_block_size=(32, 32)))
    w = synthesize_weights(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    model = ReferenceModel(cfg, w)
    logits = model.forward(model.new_state(), ids)
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std(-1).mean().item() < 2.0
    assert len(set(logits.argmax(-1).tolist())) >= 8
    w["layers.40.attn.wo_b.weight"] = torch.zeros_like(w["layers.40.attn.wo_b.weight"])
    model = ReferenceModel(cfg, w)
    changed = model.forward(model.new_state(), ids)
    assert (changed - logits).abs().mean() > 0.03 * logits.abs().mean()  # 7% today; 0.7% with 1/sqrt(2L)


@pytest.mark.parametrize("routing", ["default", "skewed"])
def test_lazy_device_weights_equal_the_eager_ones(routing):
    eager = synthesize_on_device(MICRO, 5, "cpu", routing=routing)
    lazy = LazyDeviceWeights(MICRO, 5, "cpu", routing=routing)
    assert list(lazy) == list(eager)
    names = list(eager)[::-1]  # any access order: the group of a `.scale` is its weight's
    for n in names:
        assert same_bytes(lazy[n], eager[n]), n
    assert lazy.nbytes() == {n: t.numel() * t.element_size() for n, t in eager.items()}
    del lazy[names[0]]
    assert names[0] not in lazy and len(lazy) == len(eager) - 1
    with pytest.raises(KeyError):
        lazy[names[0]]
