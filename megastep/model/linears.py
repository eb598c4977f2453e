"""The fast path's linears in their checkpoint formats: one weight (`Linear`), or several that read
the same input run as one launch (`LinearGroup`). On CUDA with V4's 128x128 blocks the FP8 ones run
in kernels/linear_fp8.py, elsewhere in its torch twin."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megastep.checkpoint import formats
from megastep.kernels import linear_fp8 as _lin


@dataclass
class Linear:
    """A linear layer in its checkpoint format: FP8 (weight e4m3 + scale) or plain (bf16/f32)."""

    w: torch.Tensor
    scale: torch.Tensor | None
    block: int
    act_quant: bool  # fp8-quantize the activation first (every FP8 linear but wo_a)

    @property
    def kernel_block(self) -> bool:
        """The FP8 kernel takes V4's 128x128 blocks only; a checkpoint with other blocks (the
        built-in tiny model's 32) runs its FP8 linears through the torch twin."""
        return self.block == _lin.BLOCK

    def __call__(self, x: torch.Tensor, triton: bool, out_dtype: torch.dtype | None = None,
                 codes: tuple[torch.Tensor, torch.Tensor] | None = None,
                 config: _lin.LinearFp8Config | None = None) -> torch.Tensor:
        """codes: x's fp8 activation quantization made beside x (linear_fp8's x_codes), or None.
        config: the FP8 kernel's configuration instead of its pick for this shape."""
        out_dtype = out_dtype or x.dtype
        if self.scale is None:  # unquantized checkpoint: plain fp32-accumulated matmul
            return (x.float() @ self.w.float().T).to(out_dtype)
        if self.act_quant:
            if triton and self.kernel_block:
                return _lin.linear_fp8(x.contiguous(), self.w, self.scale, block=self.block, out_dtype=out_dtype,
                                       x_codes=codes, config=config)
            return _lin.linear_fp8_ref(x.contiguous(), self.w, self.scale, block=self.block, out_dtype=out_dtype,
                                       x_codes=codes)
        raise ValueError("a linear without activation quantization is grouped (wo_a): call grouped()")

    def grouped(self, x: torch.Tensor, groups: int, rank: int, triton: bool,
                config: _lin.LinearFp8Config | None = None) -> torch.Tensor:
        """wo_a: x [B, G, d] -> [B, G*rank], group g through weight rows [g*rank, (g+1)*rank).
        The official code dequantizes wo_a to a plain weight: no activation quantization.
        config: the FP8 kernel's configuration instead of its pick for this shape."""
        if triton and self.kernel_block and self.scale is not None and rank % self.block == 0:  # one launch
            return _lin.linear_fp8(x.reshape(x.shape[0], -1).contiguous(), self.w, self.scale, block=self.block,
                                   quantize_act=False, groups=groups, config=config)
        w = self.w.float() if self.scale is None else formats.dequantize_fp8_weight(self.w, self.scale, self.block)
        return torch.einsum("bgd,grd->bgr", x.float(), w.view(groups, rank, -1)).to(x.dtype).flatten(1)


class LinearGroup:
    """Linears that read the same input, run as one launch over their rows concatenated at load:
    one weight stream instead of several small ones, each of which pays a launch and a ramp-up.
    Every output element is the same dot product either way, so only the split-K summation
    order (chosen per weight shape) can differ. FP8 parts are fused when each part's rows are
    whole 128-row scale blocks (always at V4 shapes); otherwise they run one by one.

    like_rows: launch with the FP8 kernel's configuration for a weight of this many rows instead
    of the group's own (a tensor-parallel rank's share of a wider group takes the full group's
    configuration, so each of its outputs is the full launch's sum, bit for bit). Needs one launch:
    a single part, or parts that fuse."""

    def __init__(self, parts: list[Linear], like_rows: int | None = None):
        self.sizes = [p.w.shape[0] for p in parts]
        self.like_rows = like_rows
        first = parts[0]
        same = all(p.act_quant == first.act_quant and p.block == first.block and (p.scale is None) == (first.scale is None)
                   for p in parts)
        whole = first.scale is None or all(n % first.block == 0 for n in self.sizes)
        if len(parts) > 1 and same and whole:
            sc = None if first.scale is None else torch.cat([p.scale for p in parts])
            self.fused, self.parts = Linear(torch.cat([p.w for p in parts]), sc, first.block, first.act_quant), []
        else:
            self.fused, self.parts = None, parts
        if like_rows is not None and self.fused is None and len(parts) > 1:
            raise ValueError("like_rows needs the group in one launch: parts that fuse")

    def with_norm_tail(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]):
        """(outputs, normed, codes) from one launch: the group's outputs and rms_norm(outputs[0], *norm,
        codes=True), the norm made by the last program to write a row tile's first-part columns
        (linear_fp8(norm_tail=): the bits of rms_norm's own launch). None where the group is not one
        FP8 kernel launch or its first part is not whole column tiles of it."""
        f = self.fused
        if f is None or not (f.kernel_block and f.scale is not None and f.act_quant):
            return None
        cfg = self._fused_config(x)
        if self.sizes[0] % cfg.block_n:
            return None
        y, (normed, codes) = _lin.linear_fp8(x.contiguous(), f.w, f.scale, block=f.block, config=cfg, norm_tail=norm)
        return list(y.split(self.sizes, dim=1)), normed, codes

    def _config(self, x: torch.Tensor, w: torch.Tensor) -> _lin.LinearFp8Config | None:
        """like_rows' configuration for x through w (None: the kernel's own pick)."""
        return None if self.like_rows is None else _lin.pick_config(x.shape[0], self.like_rows, w.shape[1])

    def _fused_config(self, x: torch.Tensor) -> _lin.LinearFp8Config:
        """The configuration the fused launch takes for x (like_rows', or the kernel's pick)."""
        f = self.fused
        return _lin.pick_config(x.shape[0], self.like_rows or f.w.shape[0], f.w.shape[1])

    def __call__(self, x: torch.Tensor, triton: bool, codes=None) -> list[torch.Tensor]:
        if self.fused is None:
            return [p(x, triton, codes=codes, config=self._config(x, p.w)) for p in self.parts]
        return list(self.fused(x, triton, codes=codes, config=self._config(x, self.fused.w)).split(self.sizes, dim=1))

    def part(self, i: int, x: torch.Tensor, triton: bool, codes=None) -> torch.Tensor:
        """Part i's output alone, in a launch of its own: for a caller that starts what needs only
        this part before the other parts are read. Its rows of the fused weight go through the
        FP8 kernel with the group launch's configuration, so each output element is the same sum
        in the same order: the bits of `self(x)[i]` (the torch twin's, too: it is `self(x)[i]`)."""
        f = self.fused
        if f is None:
            return self.parts[i](x, triton, codes=codes)
        if not (triton and f.kernel_block and f.scale is not None):
            return self(x, triton, codes=codes)[i]
        lo = sum(self.sizes[:i])
        hi = lo + self.sizes[i]
        cfg = self._fused_config(x)
        rows = Linear(f.w[lo:hi], f.scale[lo // f.block:hi // f.block], f.block, f.act_quant)
        return rows(x, triton, codes=codes, config=cfg)
