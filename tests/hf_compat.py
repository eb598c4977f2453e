"""Test helpers around transformers' DeepseekV4ForCausalLM (the bridge itself lives in
megastep.model.hf_names, which the benchmark's peer line uses too)."""

from __future__ import annotations

import torch

from megastep.model.hf_names import export_official, hf_config, load_official_into_hf, official_name  # noqa: F401


def randomize_hidden_params(model, seed: int = 0) -> None:
    """Give nonzero values to what HF initializes to zero (MODEL_SPEC §9.1: at zero they hide
    whole paths): sinks, position biases, mHC bases, router bias, tid2eid."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith((".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: p.shape[1]] for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows))
            elif name.endswith((".fn", "hc_fn")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
