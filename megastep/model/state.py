"""Per-sequence decode state of the reference model (MODEL_SPEC §4, "State per sequence").

Everything a sequence needs to continue decoding lives here, so that a prefill of P tokens
followed by N single-token steps equals one pass over P+N tokens, however the prefill is chunked:

- every layer: the sliding-window ring [W, head_dim], slot p % W holds position p;
- compressed layers: the compressor buffers (kv and score rows, fp32) and the compressed KV
  entries emitted so far; CSA layers add the indexer's own compressor buffers and index keys.

Hash-routed layers need only the current token id, which the caller passes with each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megastep.config import CSA_RATIO, ModelConfig


class GrowingRows:
    """Rows appended one at a time into a buffer that doubles when full (amortized O(1))."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str):
        self._buf = torch.empty(16, width, dtype=dtype, device=device)
        self.n = 0

    def append(self, row: torch.Tensor) -> None:
        if self.n == self._buf.shape[0]:
            grown = torch.empty(2 * self.n, self._buf.shape[1], dtype=self._buf.dtype, device=self._buf.device)
            grown[: self.n] = self._buf
            self._buf = grown
        self._buf[self.n] = row
        self.n += 1

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[: self.n]


@dataclass
class CompressorState:
    """Buffers of one compressor. Overlapping (CSA) compressors keep 2*ratio rows of 2*dim
    channels: rows [0, ratio) = the previous window, [ratio, 2*ratio) = the current one."""

    kv: torch.Tensor  # fp32 [rows, width]
    score: torch.Tensor  # fp32 [rows, width], -inf where nothing was stored
    entries: GrowingRows  # emitted compressed rows [n, dim]

    @classmethod
    def create(cls, ratio: int, dim: int, overlap: bool, dtype: torch.dtype, device) -> "CompressorState":
        coff = 2 if overlap else 1
        return cls(
            kv=torch.zeros(coff * ratio, coff * dim, dtype=torch.float32, device=device),
            score=torch.full((coff * ratio, coff * dim), float("-inf"), dtype=torch.float32, device=device),
            entries=GrowingRows(dim, dtype, device),
        )


@dataclass
class LayerState:
    window: torch.Tensor  # [W, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0  # tokens consumed so far = position of the next token

    @classmethod
    def create(cls, cfg: ModelConfig, dtype: torch.dtype, device) -> "SequenceState":
        layers = []
        for L in range(cfg.num_hidden_layers):
            r = cfg.ratio(L)
            st = LayerState(window=torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device))
            if r:
                st.compressor = CompressorState.create(r, cfg.head_dim, r == CSA_RATIO, dtype, device)
                if r == CSA_RATIO:
                    st.indexer = CompressorState.create(r, cfg.index_head_dim, True, dtype, device)
            layers.append(st)
        return cls(layers=layers)
