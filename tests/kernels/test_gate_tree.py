"""gate_tree: the MoE gate's logits with their sums in one pairwise tree over K. Every
configuration gives the bits of gate_tree_ref (the same tree in torch), at any number of rows;
the tree is within fp32 rounding of the exact sum."""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" and "megastep.kernels.gate_tree" in sys.modules:
    importlib.reload(sys.modules["megastep.kernels.gate_tree"])  # imported before the interpreter was set

from megastep.kernels import gate_tree as gt  # noqa: E402
from megastep.kernels.gate_tree import GateTreeConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [None, GateTreeConfig(1, 8, 16, 4), GateTreeConfig(4, 4, 32, 1), GateTreeConfig(2, 16, 8, 8, num_warps=2)]


def inputs(B, E, K, seed, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, K, generator=g) * torch.exp2(torch.randint(-3, 4, (B, 1), generator=g).float())).bfloat16()
    w = (torch.randn(E, K, generator=g) * K ** -0.5).bfloat16()
    return x.to(dev), w.to(dev)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("B,E,K", [(1, 32, 256), (3, 16, 200), (5, 8, 64), (17, 24, 96)])
def test_gate_tree_bits_of_the_ref(cfg, B, E, K):
    x, w = inputs(B, E, K, seed=B * 7 + E + K)
    ref = gt.gate_tree_ref(x.cpu(), w.cpu())
    y = gt.gate_tree(x, w, cfg)
    assert y.shape == (B, E) and y.dtype == torch.float32
    assert torch.equal(y.cpu(), ref)
    # x as fp32 holding the same bf16 values: the same products, the same bits
    assert torch.equal(gt.gate_tree(x.float(), w, cfg).cpu(), ref)
    exact = x.double().cpu() @ w.double().cpu().T
    scale = (x.double().cpu().abs() @ w.double().cpu().abs().T).max().item()
    assert (ref.double() - exact).abs().max().item() <= 2 ** -21 * scale * (K.bit_length() + 1)


def test_gate_tree_order_is_the_tree_not_the_sequence():
    """The tree is a real order: on values chosen so that the sequential fp32 sum and the pairwise
    tree round differently, the kernel gives the tree's result."""
    K = 4
    x = torch.tensor([[1.0, 0.0, 2.0 ** -24, 2.0 ** -24]], dtype=torch.bfloat16)
    w = torch.ones(1, K, dtype=torch.bfloat16)
    seq = ((x[0, 0].float() + x[0, 1].float()) + x[0, 2].float()) + x[0, 3].float()
    tree = (x[0, 0].float() + x[0, 1].float()) + (x[0, 2].float() + x[0, 3].float())
    assert seq.item() != tree.item()
    assert gt.gate_tree_ref(x, w)[0, 0].item() == tree.item()
    assert gt.gate_tree(x.to(DEV), w.to(DEV))[0, 0].item() == tree.item()


def test_a_row_alone_and_in_a_batch():
    x, w = inputs(9, 16, 128, seed=3)
    full = gt.gate_tree(x, w)
    for b in (0, 4, 8):
        assert torch.equal(gt.gate_tree(x[b:b + 1], w), full[b:b + 1])
    assert torch.equal(gt.gate_tree(x, w), full)  # run to run


def test_empty_and_out():
    x, w = inputs(2, 8, 32, seed=1)
    assert gt.gate_tree(x[:0], w).shape == (0, 8)
    out = torch.full((2, 8), float("nan"), device=DEV)
    assert gt.gate_tree(x, w, out=out) is out and torch.equal(out.cpu(), gt.gate_tree_ref(x.cpu(), w.cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 2, 4, 16, 64])
def test_gpu_v4_gate_bits_of_the_ref(B):
    """V4-Flash's gate (256 x 4096) on the GPU: the picked configuration and others give the ref's
    bits at every row count."""
    x, w = inputs(B, 256, 4096, seed=B, dev="cuda")
    ref = gt.gate_tree_ref(x.cpu(), w.cpu())
    for cfg in (None, GateTreeConfig(1, 16, 64, 8), GateTreeConfig(16, 16, 32, 8), GateTreeConfig(8, 8, 128, 1)):
        assert torch.equal(gt.gate_tree(x, w, cfg).cpu(), ref), cfg
