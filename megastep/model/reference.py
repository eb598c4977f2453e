"""Reference decode of DeepSeek-V4 in plain PyTorch: the oracle every fast path is checked against.

It follows the official `inference/model.py` (MODEL_SPEC §3-4) one token at a time. Processing
tokens singly makes the state semantics trivially exact: a prefill of P tokens in any chunking,
followed by N decode steps, gives bit-identical logits to one pass over P+N tokens.

Numerics (explicit choices, pinned by tests):
- `dtype` is the activation dtype: bf16 as in the official code (default) or fp32 (used for the
  parity tests against transformers, which then runs in fp32 too).
- Every matmul accumulates in fp32 and rounds its output to `dtype`; the compressor, router gate,
  mHC mixes and lm head keep fp32 outputs, as in the official code.
- Quantized weights are dequantized once at load (exact: e4m3/e2m1 times a power of two fits in
  bf16 and fp32). With `quant_sim` on (default), activations entering an FP8/FP4 linear are
  fp8-quantized per `act_block` channels, the window and compressed KV nope dims per 64, and the
  indexer's queries and keys are Hadamard-rotated and fp4-quantized per 32, as the official code
  does (MODEL_SPEC §3). `wo_a` is dequantized to a plain weight with no activation quantization,
  as in the official code.
- Index scores are computed in fp32 (the official code uses bf16 einsums; fp32 is the more
  accurate choice and the one the fast kernels take). Selected entries are sorted ascending.
- Routed experts are summed in ascending expert id (the official order), then the shared expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megastep.checkpoint import formats
from megastep.config import CSA_RATIO, ModelConfig
from megastep.errors import UserError
from megastep.model import ops
from megastep.model.ops import apply_rope, rms_norm
from megastep.model.state import CompressorState, SequenceState

class ReferenceModel:
    """Stateful single-sequence decode: `forward(state, ids)` -> fp32 logits [T, vocab]."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        quant_sim: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        self.cfg = cfg
        self.quant_sim = quant_sim
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(iter(weights.values())).device
        self.act_block = cfg.act_block
        self.w: dict[str, torch.Tensor] = {}
        self.quantized: set[str] = set()  # weights whose linears take quantized activations
        for name, t in weights.items():
            if name.endswith(".scale") or name.startswith("mtp."):
                continue
            t = t.to(self.device)
            if t.dtype == torch.float8_e4m3fn:
                t = formats.dequantize_fp8_weight(t, weights[name[: -len(".weight")] + ".scale"].to(self.device), cfg.fp8_block)
                self.quantized.add(name)
            elif t.dtype == torch.int8:
                t = formats.dequantize_mxfp4_weight(t, weights[name[: -len(".weight")] + ".scale"].to(self.device))
                self.quantized.add(name)
            # Everything floating is kept in fp32: exact for bf16 and dequantized FP8/FP4 values,
            # and every matmul runs in fp32 without converting its weight on each call.
            self.w[name] = t.float() if t.is_floating_point() else t
        self.inv_freq = {c: ops.rope_inv_freq(cfg, c).to(self.device) for c in (False, True)}

    # ---- building blocks --------------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState.create(self.cfg, self.dtype, self.device)

    def linear(self, x: torch.Tensor, name: str, out_fp32: bool = False) -> torch.Tensor:
        """y = x W^T with fp32 accumulation; FP8/FP4 weights first quantize x (when simulating)."""
        if self.quant_sim and name in self.quantized:
            x = formats.fp8_act_sim(x, self.act_block)
        y = x.float() @ self.w[name].T
        return y if out_fp32 else y.to(x.dtype)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.cfg.rms_norm_eps)

    def hc_pre(self, h: torch.Tensor, prefix: str):
        """mHC pre: h [hc, D] -> (collapsed [D], post [hc], comb [hc, hc])."""
        return ops.hc_pre(h, self.w[prefix + "_fn"], self.w[prefix + "_scale"], self.w[prefix + "_base"], self.cfg)

    # ---- compressor ---------------------------------------------------------------------
    def compress(self, x: torch.Tensor, st: CompressorState, prefix: str, ratio: int, dim: int, pos: int, rotate: bool):
        """Feed one token into a compressor; when its window closes, append one entry.

        Overlapping (ratio 4) compressors project to 2*dim channels [Ca | Cb]; an entry pools
        the previous window's Ca rows with the current window's Cb rows (8 rows per channel)."""
        xf = x.float()
        kv = xf @ self.w[prefix + ".wkv.weight"].T
        score = xf @ self.w[prefix + ".wgate.weight"].T + self.w[prefix + ".ape"][pos % ratio]
        overlap = ratio == CSA_RATIO
        row = (ratio if overlap else 0) + pos % ratio
        st.kv[row], st.score[row] = kv, score
        if (pos + 1) % ratio:
            return
        if overlap:
            kvs = torch.cat([st.kv[:ratio, :dim], st.kv[ratio:, dim:]], 0)
            scs = torch.cat([st.score[:ratio, :dim], st.score[ratio:, dim:]], 0)
            st.kv[:ratio], st.score[:ratio] = st.kv[ratio:].clone(), st.score[ratio:].clone()
        else:
            kvs, scs = st.kv, st.score
        e = (kvs * torch.softmax(scs, dim=0)).sum(0)
        e = self.norm(e.to(self.dtype), prefix + ".norm.weight")
        e = apply_rope(e, self.inv_freq[True], pos + 1 - ratio)
        if self.quant_sim:
            e = ops.index_sim(e) if rotate else ops.kv_sim(e, self.cfg.nope_head_dim)
        st.entries.append(e)

    # ---- attention ----------------------------------------------------------------------
    def indexer_topk(self, x: torch.Tensor, qr: torch.Tensor, st: CompressorState, L: int, pos: int) -> torch.Tensor:
        cfg = self.cfg
        p = f"layers.{L}.attn.indexer"
        self.compress(x, st, p + ".compressor", CSA_RATIO, cfg.index_head_dim, pos, rotate=True)
        visible = (pos + 1) // CSA_RATIO
        if visible == 0:
            return torch.empty(0, dtype=torch.long, device=self.device)
        q = self.linear(qr, p + ".wq_b.weight").view(cfg.index_n_heads, cfg.index_head_dim)
        q = apply_rope(q, self.inv_freq[True], pos)
        if self.quant_sim:
            q = ops.index_sim(q)
        w = self.linear(x, p + ".weights_proj.weight").float() * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        keys = st.entries.rows[:visible]
        scores = (torch.relu(q.float() @ keys.float().T) * w[:, None]).sum(0)  # [visible]
        k = min(cfg.index_topk, visible)
        return scores.topk(k).indices.sort().values

    def attention(self, x: torch.Tensor, L: int, pos: int, ls) -> torch.Tensor:
        cfg = self.cfg
        p = f"layers.{L}.attn"
        ratio = cfg.ratio(L)
        inv_freq = self.inv_freq[ratio > 0]
        H, hd = cfg.num_attention_heads, cfg.head_dim

        qr = self.norm(self.linear(x, p + ".wq_a.weight"), p + ".q_norm.weight")
        q = self.linear(qr, p + ".wq_b.weight").view(H, hd)
        q = rms_norm(q, None, cfg.rms_norm_eps)
        q = apply_rope(q, inv_freq, pos)

        kv = self.norm(self.linear(x, p + ".wkv.weight"), p + ".kv_norm.weight")
        kv = apply_rope(kv, inv_freq, pos)
        if self.quant_sim:
            kv = ops.kv_sim(kv, cfg.nope_head_dim)
        W = cfg.sliding_window
        ls.window[pos % W] = kv
        parts = [ls.window[: min(pos + 1, W)]]

        if ratio:
            selected = None
            if ratio == CSA_RATIO:
                selected = self.indexer_topk(x, qr, ls.indexer, L, pos)
            self.compress(x, ls.compressor, p + ".compressor", ratio, hd, pos, rotate=False)
            entries = ls.compressor.entries.rows[: (pos + 1) // ratio]
            parts.append(entries if selected is None else entries[selected])

        o = ops.sparse_attention(q, torch.cat(parts, 0), self.w[p + ".attn_sink"], hd**-0.5)
        o = apply_rope(o, inv_freq, pos, inverse=True)

        G = cfg.o_groups
        wo_a = self.w[p + ".wo_a.weight"].view(G, cfg.o_lora_rank, -1)
        u = torch.einsum("gd,grd->gr", o.float().view(G, -1), wo_a).to(x.dtype)
        return self.linear(u.flatten(), p + ".wo_b.weight")

    # ---- MoE ----------------------------------------------------------------------------
    def expert(self, x: torch.Tensor, prefix: str, weight: torch.Tensor | None = None) -> torch.Tensor:
        lim = self.cfg.swiglu_limit
        a = ops.swiglu(self.linear(x, prefix + ".w1.weight"), self.linear(x, prefix + ".w3.weight"), lim)
        if weight is not None:
            a = weight * a  # official order: routing weight before w2
        return self.linear(a.to(x.dtype), prefix + ".w2.weight")

    def route(self, x: torch.Tensor, L: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        p = f"layers.{L}.ffn.gate"
        scores = torch.sqrt(F.softplus(self.linear(x, p + ".weight", out_fp32=True)))
        if cfg.is_hash_layer(L):
            idx = self.w[p + ".tid2eid"][token].long()
        else:
            idx = (scores + self.w[p + ".bias"]).topk(cfg.num_experts_per_tok).indices
        return idx, ops.route_weights(scores, idx, cfg.routed_scaling_factor)

    def moe(self, x: torch.Tensor, L: int, token: int) -> torch.Tensor:
        p = f"layers.{L}.ffn"
        idx, w = self.route(x, L, token)
        y = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        for slot in torch.argsort(idx).tolist():  # ascending expert id, as the official loop
            y += self.expert(x, f"{p}.experts.{int(idx[slot])}", w[slot]).float()
        y += self.expert(x, p + ".shared_experts").float()
        return y.to(x.dtype)

    # ---- whole step ---------------------------------------------------------------------
    def step(self, state: SequenceState, token: int) -> torch.Tensor:
        """Decode one token at position state.pos; returns fp32 logits [vocab]."""
        cfg = self.cfg
        pos = state.pos
        h = self.w["embed.weight"][token].to(self.dtype).expand(cfg.hc_mult, -1)
        for L in range(cfg.num_hidden_layers):
            pre = f"layers.{L}."
            x, post, comb = self.hc_pre(h, pre + "hc_attn")
            h = ops.hc_post(self.attention(self.norm(x, pre + "attn_norm.weight"), L, pos, state.layers[L]), h, post, comb)
            x, post, comb = self.hc_pre(h, pre + "hc_ffn")
            h = ops.hc_post(self.moe(self.norm(x, pre + "ffn_norm.weight"), L, token), h, post, comb)
        z = self.norm(ops.hc_head(h, self.w["hc_head_fn"], self.w["hc_head_scale"], self.w["hc_head_base"], cfg), "norm.weight")
        state.pos += 1
        return z.float() @ self.w["head.weight"].T

    @torch.inference_mode()
    def forward(self, state: SequenceState, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Consume tokens at positions state.pos.. and return their fp32 logits [T, vocab]."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if not ids:
            raise UserError("empty prompt: give at least one token")
        if state.pos + len(ids) > self.cfg.max_position_embeddings:
            raise UserError(
                f"sequence of {state.pos + len(ids)} tokens exceeds the model's limit of "
                f"{self.cfg.max_position_embeddings} (max_position_embeddings)"
            )
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return torch.stack([self.step(state, t) for t in ids])
