"""The official tensor table (MODEL_SPEC §2.2) and its validation."""

import collections

import pytest
import torch

from megastep.checkpoint.tensors import ROLES, expected_tensors, find_problems, validate
from megastep.config import ModelConfig
from megastep.errors import CheckpointError

V4 = ModelConfig()


@pytest.fixture(scope="module")
def v4_table():
    return expected_tensors(V4)


def per_layer_counts(table):
    return collections.Counter(n.split(".")[1] for n in table if n.startswith("layers."))


def test_per_layer_counts_match_official(v4_table):
    counts = per_layer_counts(v4_table)
    by_kind = collections.defaultdict(set)
    for L in range(V4.num_hidden_layers):
        by_kind[V4.layer_kind(L)].add(counts[str(L)])
    assert by_kind == {"sliding": {1565}, "csa": {1576}, "hca": {1569}}


def test_total_count_and_mtp(v4_table):
    # 2 SWA + 21 CSA + 20 HCA layers + 6 globals, and one MTP block (+ e/h_proj, norms, hc_head).
    main = 2 * 1565 + 21 * 1576 + 20 * 1569 + 6
    mtp = [n for n in v4_table if n.startswith("mtp.")]
    assert len(mtp) == 1565 + 10
    assert len(v4_table) == main + len(mtp)
    assert len(expected_tensors(V4, include_mtp=False)) == main
    assert "mtp.0.ffn.gate.bias" in v4_table and "mtp.0.ffn.gate.tid2eid" not in v4_table


def test_named_shapes_and_dtypes(v4_table):
    t = v4_table
    fp8, e8m0, i8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8
    want = {
        "embed.weight": (torch.bfloat16, (129280, 4096)),
        "hc_head_fn": (torch.float32, (4, 16384)),
        "hc_head_scale": (torch.float32, (1,)),
        "layers.0.hc_attn_fn": (torch.float32, (24, 16384)),
        "layers.0.hc_ffn_scale": (torch.float32, (3,)),
        "layers.0.attn.wq_b.weight": (fp8, (32768, 1024)),
        "layers.0.attn.wq_b.scale": (e8m0, (256, 8)),
        "layers.0.attn.wo_a.weight": (fp8, (8192, 4096)),
        "layers.0.attn.wo_a.scale": (e8m0, (64, 32)),
        "layers.0.attn.wo_b.scale": (e8m0, (32, 64)),
        "layers.0.ffn.gate.tid2eid": (torch.int64, (129280, 6)),
        "layers.3.ffn.gate.bias": (torch.float32, (256,)),
        "layers.2.attn.compressor.wkv.weight": (torch.bfloat16, (1024, 4096)),
        "layers.2.attn.compressor.ape": (torch.float32, (4, 1024)),
        "layers.2.attn.compressor.norm.weight": (torch.bfloat16, (512,)),
        "layers.2.attn.indexer.wq_b.scale": (e8m0, (64, 8)),
        "layers.2.attn.indexer.weights_proj.weight": (torch.bfloat16, (64, 4096)),
        "layers.2.attn.indexer.compressor.wgate.weight": (torch.bfloat16, (256, 4096)),
        "layers.2.attn.indexer.compressor.ape": (torch.float32, (4, 256)),
        "layers.2.attn.indexer.compressor.norm.weight": (torch.bfloat16, (128,)),
        "layers.3.attn.compressor.wkv.weight": (torch.bfloat16, (512, 4096)),
        "layers.3.attn.compressor.ape": (torch.float32, (128, 512)),
        "layers.5.ffn.experts.255.w1.weight": (i8, (2048, 2048)),
        "layers.5.ffn.experts.255.w1.scale": (e8m0, (2048, 128)),
        "layers.5.ffn.experts.0.w2.weight": (i8, (4096, 1024)),
        "layers.5.ffn.experts.0.w2.scale": (e8m0, (4096, 64)),
        "layers.5.ffn.shared_experts.w1.scale": (e8m0, (16, 32)),
        "layers.5.ffn.shared_experts.w2.weight": (fp8, (4096, 2048)),
        "mtp.0.e_proj.weight": (fp8, (4096, 4096)),
        "mtp.0.hc_head_base": (torch.float32, (4,)),
    }
    for name, (dtype, shape) in want.items():
        assert (t[name].dtype, t[name].shape) == (dtype, shape), name
    assert "layers.3.attn.indexer.wq_b.weight" not in t
    assert "layers.0.attn.compressor.ape" not in t
    assert {s.role for s in t.values()} <= set(ROLES)
    assert t["layers.7.ffn.experts.1.w3.weight"].role == "routed_expert"
    assert t["layers.2.attn.indexer.compressor.ape"].role == "indexer"


def test_unquantized_has_no_scales_and_accepts_fp32():
    cfg = V4.replace(quantization_config=None, expert_dtype=None, num_hidden_layers=4,
                     compress_ratios=(0, 4, 128, 4, 0))
    t = expected_tensors(cfg)
    assert not [n for n in t if n.endswith(".scale") and "hc_" not in n]
    w = t["layers.1.ffn.experts.0.w1.weight"]
    assert (w.dtype, w.shape) == (torch.bfloat16, (2048, 4096)) and w.accepts(torch.float32)
    assert t["layers.1.attn.q_norm.weight"].accepts(torch.float32)
    assert not t["layers.1.attn.attn_sink"].accepts(torch.bfloat16)
    # Quantized: BF16 tensors are strict.
    assert not expected_tensors(V4, include_mtp=False)["norm.weight"].accepts(torch.float32)


def test_fp8_experts_and_ragged_blocks():
    cfg = V4.replace(expert_dtype="fp8", num_hidden_layers=1, compress_ratios=(0, 0),
                     hidden_size=200, moe_intermediate_size=100)
    t = expected_tensors(cfg, include_mtp=False)
    assert t["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.ffn.experts.0.w1.scale"].shape == (1, 2)  # ceil(100/128), ceil(200/128)
    assert t["layers.0.ffn.experts.0.w1.scale"].accepts(torch.float32)


def _found(table):
    return {n: (s.dtype, s.shape) for n, s in table.items()}


SMALL = V4.replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0), n_routed_experts=4,
                   num_experts_per_tok=2, num_hash_layers=1, hidden_size=256, vocab_size=1000,
                   moe_intermediate_size=128)


def test_validate_accepts_exact_table():
    validate(SMALL, _found(expected_tensors(SMALL)))
    # Without require_mtp a checkpoint lacking MTP entirely is fine; a partial MTP is not.
    validate(SMALL, _found(expected_tensors(SMALL, include_mtp=False)), require_mtp=False)
    partial = _found(expected_tensors(SMALL))
    del partial["mtp.0.e_proj.weight"]
    with pytest.raises(CheckpointError, match="mtp.0.e_proj.weight"):
        validate(SMALL, partial, require_mtp=False)


def test_validate_lists_every_kind_of_problem():
    f = _found(expected_tensors(SMALL))
    del f["layers.1.attn.wq_a.weight"]
    f["layers.1.attn.bogus"] = ("F32", [3])
    f["layers.0.attn.attn_sink"] = ("BF16", [64])
    f["layers.2.attn.compressor.ape"] = (torch.float32, (4, 512))
    with pytest.raises(CheckpointError) as e:
        validate(SMALL, f, ["model-00002-of-00002.safetensors"])
    msg = str(e.value)
    for piece in ("missing tensors (1)", "layers.1.attn.wq_a.weight", "unexpected tensors (1)",
                  "layers.1.attn.bogus", "wrong dtype", "attn_sink is BF16, expected F32",
                  "wrong shape", "ape is [4, 512], expected [128, 512]",
                  "model-00002-of-00002.safetensors"):
        assert piece in msg, piece


def test_validate_caps_long_listings_and_hints_at_config():
    f = _found(expected_tensors(SMALL.replace(hidden_size=512)))
    problems = find_problems(SMALL, f)
    assert "config.json does not match the tensors" in problems[0]
    assert "hidden_size 256" in problems[0]
    shape = [p for p in problems if p.startswith("tensors with the wrong shape")][0]
    assert "... and" in shape and shape.count("\n") <= 22
