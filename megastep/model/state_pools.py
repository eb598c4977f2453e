"""The fast path's per-sequence state: every layer's window ring, compressor states and compressed
entries in fixed pools addressed by slot id, so that a step's shapes never change."""

from __future__ import annotations

import torch

from megastep.config import CSA_RATIO, ModelConfig


class StatePools:
    """Per-sequence state of every layer in fixed pools indexed by slot; the last slot is the
    dummy that padding rows write to. Compressed-entry pools have one extra discard row. The
    window ring holds sliding_window + max_block - 1 rows: a step that advances a sequence by a
    block of up to max_block tokens writes them all before attending, and the block's first row
    must still find its sliding_window - 1 predecessors."""

    def __init__(self, cfg: ModelConfig, max_seqs: int, max_ctx: int, dtype: torch.dtype, device, max_block: int = 1):
        self.cfg, self.max_ctx, self.max_block = cfg, max_ctx, max_block
        S = max_seqs + 1
        self.dummy_slot = max_seqs
        self.win, self.ckv, self.csc, self.cent, self.ikv, self.isc, self.ikeys = ([] for _ in range(7))
        for L in range(cfg.num_hidden_layers):
            r = cfg.ratio(L)
            self.win.append(torch.zeros(S, cfg.sliding_window + max_block - 1, cfg.head_dim, dtype=dtype, device=device))
            ckv = csc = cent = ikv = isc = ikeys = None
            if r:
                coff = 2 if r == CSA_RATIO else 1
                ckv = torch.zeros(S, coff * r, coff * cfg.head_dim, dtype=torch.float32, device=device)
                csc = torch.full_like(ckv, float("-inf"))
                cent = torch.zeros(S, max_ctx // r + 1, cfg.head_dim, dtype=dtype, device=device)
                if r == CSA_RATIO:
                    ikv = torch.zeros(S, 2 * r, 2 * cfg.index_head_dim, dtype=torch.float32, device=device)
                    isc = torch.full_like(ikv, float("-inf"))
                    ikeys = torch.zeros(S, max_ctx // r + 1, cfg.index_head_dim, dtype=dtype, device=device)
            for lst, t in zip((self.ckv, self.csc, self.cent, self.ikv, self.isc, self.ikeys), (ckv, csc, cent, ikv, isc, ikeys)):
                lst.append(t)

    def reset(self, slot: int) -> None:
        """Make a slot a fresh sequence: compressor scores -inf (no rows stored), values zero."""
        for lst in (self.win, self.ckv, self.cent, self.ikv, self.ikeys):
            for t in lst:
                if t is not None:
                    t[slot].zero_()
        for lst in (self.csc, self.isc):
            for t in lst:
                if t is not None:
                    t[slot].fill_(float("-inf"))

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lst in (self.win, self.ckv, self.csc, self.cent, self.ikv, self.isc, self.ikeys)
                   for t in lst if t is not None)
