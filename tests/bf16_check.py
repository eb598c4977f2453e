"""Comparing bf16 kernel outputs with their refs: distance in bf16 steps, and the kernels' shared
acceptance rule (at most one step off anywhere, and almost every element bit-equal)."""

import torch


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (ulps) between two bf16 tensors."""
    ia, ib = (t.contiguous().view(torch.int16).int() for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def check_bf16(y: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.99) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype == torch.bfloat16
    y, ref = y.cpu(), ref.cpu()
    assert torch.isfinite(y.float()).all()
    steps = bf16_steps(y, ref)
    close = (steps <= 1) | ((y.float() - ref.float()).abs() <= 1e-5 * ref.float().abs().max())
    assert close.all(), f"{(~close).sum().item()} elements more than one bf16 step off (max {steps.max().item()})"
    unequal = (steps > 0).sum().item()
    assert unequal <= max(2, (1 - min_equal) * y.numel()), f"{unequal} of {y.numel()} elements not bit-equal"
