"""Parity of the reference decode with transformers' DeepseekV4ForCausalLM (MODEL_SPEC §9.1).

One checkpoint on disk under the official tensor names is loaded by both: transformers through
its own official-name conversion, megastep through its loader. The checkpoint is written by
other code than megastep's (exported from a transformers model), which also covers "a
checkpoint written by other code loads and decodes identically".

Both run in fp32 with megastep's quantization simulations off (transformers has none).
Tolerance: the two differ only in summation order (matmul blocking, softmax and MoE sums), so
logits agree to fp32 rounding amplified through the layers; we allow 1e-4 relative to the
largest logit (observed: ~1e-6). Greedy tokens must be identical for 64 decode steps.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_compat import export_official, hf_config, load_official_into_hf, randomize_hidden_params
from megastep.checkpoint.loader import load_checkpoint
from megastep.config import ModelConfig
from megastep.model.reference import ReferenceModel

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hash_layers=1, index_n_heads=16, index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=2,
    hc_sinkhorn_iters=5, max_position_embeddings=256, quantization_config=None, expert_dtype=None,
    num_nextn_predict_layers=0,
)
LAYOUTS = {
    "mixed": (0, 4, 8, 4),
    "sliding": (0, 0),
    "csa": (4, 4),
    "hca": (8, 8),
}
PROMPT, DECODE = 40, 64
TOL = 1e-4


def healthy_init(model, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in) so activations stay O(1) through the layers (HF's 0.02 init
    shrinks them and would let whole paths contribute nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2 and not name.endswith((".fn", "hc_fn")):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    randomize_hidden_params(model, seed)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    ratios = LAYOUTS[request.param]
    cfg = ModelConfig(num_hidden_layers=len(ratios), compress_ratios=ratios, **TINY)
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    healthy_init(hf, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(export_official(hf), str(d / "model.safetensors"))
    return cfg, d


def test_config_round_trips_through_disk(checkpoint):
    cfg, d = checkpoint
    assert ModelConfig.from_json(d) == cfg


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    cfg, d = checkpoint
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(d, config=hf_config(cfg), dtype=torch.float32).eval()
    cfg2, weights = load_checkpoint(d, progress=False)
    assert cfg2 == cfg
    ref = ReferenceModel(cfg, weights, quant_sim=False, dtype=torch.float32)

    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        # transformers' own cached decode: prefill, then one token per call through its cache
        out = hf(prompt, use_cache=True)
        hf_prefill, cache = out.logits[0], out.past_key_values
        hf_tokens, hf_steps = [], [hf_prefill[-1]]
        for _ in range(DECODE):
            hf_tokens.append(int(hf_steps[-1].argmax()))
            out = hf(torch.tensor([[hf_tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            hf_steps.append(out.logits[0, -1])
    hf_step_logits = torch.stack(hf_steps[:-1])

    state = ref.new_state()
    ours_prefill = ref.forward(state, prompt[0])
    scale = hf_prefill.abs().max()
    assert scale > 1.0, "degenerate logits: the test would not see errors"
    assert (ours_prefill - hf_prefill).abs().max() <= TOL * scale

    ours_tokens, ours_step_logits = [], [ours_prefill[-1]]
    for _ in range(DECODE):
        tok = int(ours_step_logits[-1].argmax())
        ours_tokens.append(tok)
        ours_step_logits.append(ref.forward(state, [tok])[0])
    assert ours_tokens == hf_tokens
    diff = (torch.stack(ours_step_logits[:-1]) - hf_step_logits).abs().max()
    assert diff <= TOL * hf_step_logits.abs().max(), f"max logit diff {diff}"
    # the run crossed the window and several compression windows
    assert state.pos == PROMPT + DECODE > 8 * cfg.sliding_window


def test_paths_are_live(checkpoint):
    """Guard against a parity that holds only because a path contributes nothing: perturbing
    the compressor / sinks must move the logits."""
    cfg, d = checkpoint
    _, weights = load_checkpoint(d, progress=False)
    ids = torch.arange(PROMPT) % cfg.vocab_size
    m = ReferenceModel(cfg, weights, quant_sim=False, dtype=torch.float32)
    base = m.forward(m.new_state(), ids)
    for key in [k for k in weights if k.endswith(("attn_sink", "compressor.ape", "indexer.compressor.ape"))]:
        w2 = dict(weights)
        # random, not constant: a uniform shift of ape cancels in the softmax over rows
        w2[key] = weights[key] + torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(0))
        m = ReferenceModel(cfg, w2, quant_sim=False, dtype=torch.float32)
        moved = (m.forward(m.new_state(), ids) - base).abs().max()
        assert moved > 1e-3, f"{key} has no effect on the logits"


QUANTIZED_FP8 = (".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_a.weight", ".wo_b.weight", "shared_experts.w1.weight",
                 "shared_experts.w2.weight", "shared_experts.w3.weight")


def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(tmp_path):
    """MODEL_SPEC §9.1 tier 5: the tiny model stored in the official formats (FP8 block-scaled,
    MXFP4 experts) decodes like transformers running the dequantized weights (sims off)."""
    from megastep.checkpoint import formats
    from megastep.config import QuantConfig

    ratios = LAYOUTS["mixed"]
    block = 32
    cfg = ModelConfig(num_hidden_layers=len(ratios), compress_ratios=ratios, **TINY).replace(
        quantization_config=QuantConfig(weight_block_size=(block, block)), expert_dtype="fp4"
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    healthy_init(hf, seed=11)
    official = export_official(hf)
    stored: dict[str, torch.Tensor] = {}
    for name, t in official.items():
        if ".experts." in name and ".shared_experts." not in name:
            q, s = formats.quantize_mxfp4_weight(t)
            # the values transformers gets are computed without megastep's unpacking, so a
            # wrong nibble order or scale layout in the loader path would show
            sc = formats.e8m0_to_float(s).repeat_interleave(32, 1)
            deq = formats.round_e2m1(t / sc) * sc
        elif (name.endswith(QUANTIZED_FP8) and ".compressor." not in name) or name.endswith("indexer.wq_b.weight"):
            q, s = formats.quantize_fp8_weight(t, block)
            sc = formats.e8m0_to_float(s).repeat_interleave(block, 0).repeat_interleave(block, 1)[: t.shape[0], : t.shape[1]]
            deq = formats.round_e4m3(t / sc) * sc
        else:
            stored[name] = t.to(torch.bfloat16) if t.dtype == torch.float32 and _is_bf16_in_official(name) else t
            continue
        stored[name], stored[name[: -len(".weight")] + ".scale"] = q, s
        official[name] = deq
    # transformers gets exactly the values the checkpoint holds
    hf_values = {k: (v.float() if v.is_floating_point() else v) for k, v in stored.items() if not k.endswith(".scale")}
    hf_values.update({k: official[k] for k in hf_values if stored[k].dtype in (torch.float8_e4m3fn, torch.int8)})
    load_official_into_hf(hf, hf_values)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(stored, str(tmp_path / "model.safetensors"))

    cfg2, weights = load_checkpoint(tmp_path, progress=False)
    assert cfg2 == cfg and weights["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    ref = ReferenceModel(cfg, weights, quant_sim=False, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits[0]
    got = ref.forward(ref.new_state(), ids[0])
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _is_bf16_in_official(name: str) -> bool:
    """BF16 in the official checkpoint (MODEL_SPEC §2.1); fp32 tensors stay fp32."""
    return not name.endswith(("attn_sink", ".ape", "gate.bias", "_fn", "_base", "_scale"))
