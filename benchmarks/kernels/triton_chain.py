"""chain_probe.py's `--tchain` entries: a chain_probe.Chain through linear_chain.py (the
chain of FP8 linears in one persistent Triton launch with linear_fp8's loop and bits), and the same
kernel a launch a layer.

Why (2026-12-06): chain_probe.cu asked whether one persistent launch removes the ~6 us each 1-row FP8
stream pays at its launch boundary, but its hand-written CUDA loops streamed below Triton's rate even a
launch a layer (2026-12-05), so it could not separate the boundary from the loop. This keeps the step's
own Triton loop and changes only the launch structure.

Every layer's activation is quantized here, as chain_probe's checks and its Triton row take them (the
step's wo_a takes its own unquantized; the loads are the same either way). A layer's gap (CHAINS: the
latency-bound stage before it in the step) is spun by each program after its first wait in that layer,
standing for that stage run inside the persistent launch while the programs' weight prefetches fly.
"""

from __future__ import annotations

import torch

import linear_chain as LC


class TritonChain:
    """chain: chain_probe.Chain (its weights, x0 and fp32 ys); programs: P of the one launch."""

    def __init__(self, chain, programs: int, quant: tuple[bool, ...] | None = None):
        self.chain = chain
        self.quant = quant or (True,) * len(chain.layers)
        self.lc = LC.LinearChain([LC.ChainLayer(ly.w, ly.ws, ly.G, q, torch.float32)
                                  for ly, q in zip(chain.layers, self.quant)], programs)

    def launch(self, mode: str = "chain", gaps_us: list[float] | None = None) -> None:
        """mode "chain" (one launch) or "sep" (a launch a layer); gaps_us: chain_probe.gaps_us's."""
        c = self.chain
        self.lc(c.x0[None], [y[None] for y in c.ys], mode, [round(g * 1000) for g in gaps_us or [0.0] * len(c.ys)])
