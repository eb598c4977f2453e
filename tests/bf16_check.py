"""Comparing bf16 kernel outputs with their refs: distance in bf16 steps, and the kernels' shared
acceptance rule (at most one step off anywhere, and almost every element bit-equal)."""

import torch


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (ulps) between two bf16 tensors."""
    ia, ib = (t.contiguous().view(torch.int16).int() for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def check_bf16(y: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.99, max_steps: int = 1) -> None:
    """max_steps: 2 for an output rounded to bf16 twice in a row (a value rounded to bf16, then
    scaled and rounded again, as an RMSNorm of a bf16 collapse): a flip of the first rounding
    moves the second result by a step, and its own rounding may add one."""
    assert y.shape == ref.shape and y.dtype == ref.dtype == torch.bfloat16
    y, ref = y.cpu(), ref.cpu()
    assert torch.isfinite(y.float()).all()
    steps = bf16_steps(y, ref)
    close = (steps <= max_steps) | ((y.float() - ref.float()).abs() <= 1e-5 * ref.float().abs().max())
    assert close.all(), f"{(~close).sum().item()} elements more than {max_steps} bf16 step(s) off (max {steps.max().item()})"
    unequal = (steps > 0).sum().item()
    assert unequal <= max(2, (1 - min_equal) * y.numel()), f"{unequal} of {y.numel()} elements not bit-equal"
