"""Bridges to transformers' DeepseekV4ForCausalLM: the independent reference of the tests and
the peer line of the benchmark (MODEL_SPEC §2.4, §9.1).

- `hf_config(cfg)`: a DeepseekV4Config with layer types, compress rates, hash layers and YaRN set
  explicitly (HF's defaults differ from V4-Flash: see MODEL_SPEC §9.1).
- `export_official(model)`: an HF model's weights under the official tensor names, the inverse of
  transformers' own conversion (MODEL_SPEC §2.4), so that "a checkpoint written by other code"
  can be tested.
"""

from __future__ import annotations

import re

import torch

from megastep.config import CSA_RATIO, ModelConfig


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    layer_types, rates = [], {}
    for L in range(cfg.num_hidden_layers):
        r = cfg.ratio(L)
        t = "sliding_attention" if r == 0 else ("compressed_sparse_attention" if r == CSA_RATIO else "heavily_compressed_attention")
        if r:
            if rates.get(t, r) != r:
                raise ValueError("transformers supports one compress rate per attention type")
            rates[t] = r
        layer_types.append(t)
    rates.setdefault("compressed_sparse_attention", CSA_RATIO)
    rates.setdefault("heavily_compressed_attention", 128)
    rs = cfg.rope_scaling
    rope = {}
    if rs is not None:
        rope = {
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
        }
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=1,
        routed_scaling_factor=cfg.routed_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters=rope or None,
        layer_types=layer_types,
        compress_rates=rates,
        num_hash_layers=cfg.num_hash_layers,
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit,
        sliding_window=cfg.sliding_window,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        rms_norm_eps=cfg.rms_norm_eps,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False,
    )


# HF name -> official name, applied in order as regex substitutions on the HF key.
_RULES = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"(compressor(?:\.indexer)?)\.kv_norm\.", r"\1.norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.position_bias$", ".ape"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.", ".ffn."),
]


def official_name(hf_key: str) -> str:
    k = hf_key
    for pat, rep in _RULES:
        k = re.sub(pat, rep, k)
    return k


def export_official(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF DeepseekV4ForCausalLM -> {official name: tensor}; routed experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float32:
            t = t.to(dtype)
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key)
        if m:
            L, which = m.groups()
            for e in range(t.shape[0]):
                base = f"layers.{L}.ffn.experts.{e}"
                if which == "gate_up_proj":
                    inter = t.shape[1] // 2
                    out[f"{base}.w1.weight"] = t[e, :inter].clone()
                    out[f"{base}.w3.weight"] = t[e, inter:].clone()
                else:
                    out[f"{base}.w2.weight"] = t[e].clone()
            continue
        out[official_name(key)] = t
    return out


def load_official_into_hf(hf, values) -> None:
    """Copy tensors named officially (plain floating values: dequantize first) into an HF model;
    routed experts are stacked into its gate_up_proj / down_proj. `values` is any mapping (it is
    read one tensor at a time, so a lazily dequantizing mapping keeps memory flat)."""
    by_official = {official_name(k): p for k, p in list(hf.named_parameters()) + list(hf.named_buffers())}
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                L = key.split(".")[2]
                for e in range(p.shape[0]):
                    base = f"layers.{L}.ffn.experts.{e}"
                    if key.endswith("gate_up_proj"):
                        inter = p.shape[1] // 2
                        p[e, :inter].copy_(values[f"{base}.w1.weight"])
                        p[e, inter:].copy_(values[f"{base}.w3.weight"])
                    else:
                        p[e].copy_(values[f"{base}.w2.weight"])
        for name in values:
            if name in by_official and ".ffn.experts." not in name:
                by_official[name].copy_(values[name])
