"""benchmarks/kernels/triton_chain.py (a probe: a chain of FP8 linears at one row in one persistent Triton
launch with linear_fp8's loop): every layer's output has linear_fp8's bits, in one launch and a launch a
layer, with and without the activation quantization; its counters are back at zero after a launch; the
item order and the shapes it refuses. On the CPU through the interpreter with one program (programs run
one after another there), on the GPU with several per SM."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks", "kernels"))

import chain_probe as CP  # noqa: E402
import triton_chain as TC  # noqa: E402

from megastep.kernels import linear_fp8 as LIN  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# a split layer, a grouped layer reading the first 256 outputs, a layer of 4 splits
SMALL = ((256, 256, 1, 0.0), (512, 128, 2, 1.0), (128, 512, 1, 0.0))


def _check_bits(chain, tc, mode, gaps=None, ref_quant=None):
    for y in chain.ys:
        y.fill_(float("nan"))
    tc.launch(mode, gaps)
    for i, ly in enumerate(chain.layers):
        ref = LIN.linear_fp8(chain.x(i), ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G,
                             quantize_act=(ref_quant or tc.quant)[i])[0]
        assert torch.equal(ref, chain.ys[i]), (mode, i, int((ref != chain.ys[i]).sum()))
    assert tc.exit.tolist() == [0, 0]  # the programs-out count reset, no wait gave up
    assert not tc.chunks.any() and not any(c.any() for c in tc.tile_cnt)


@pytest.mark.parametrize("quant", [None, (True, False, True)])
def test_chain_has_linear_fp8s_bits(quant):
    chain = CP.Chain(SMALL, torch.Generator(device=DEV).manual_seed(0), device=DEV)
    programs = 1 if DEV == "cpu" else 4 * torch.cuda.get_device_properties(0).multi_processor_count
    tc = TC.TritonChain(chain, programs, quant=quant)
    assert [(p["kps"], p["splits"]) for p in tc.params] == [(128, 2), (128, 1), (128, 4)]
    for mode in ("chain", "sep", "chain"):
        _check_bits(chain, tc, mode)
    if DEV == "cuda":  # the gaps spin on the global timer (no PTX under the interpreter)
        _check_bits(chain, tc, "chain", [0.0, 2.0, 1.0])


def test_check_can_fail():
    """The bit check above fails when one layer's arithmetic differs from the reference's: the grouped
    layer run without its activation quantization, checked against linear_fp8 with it."""
    chain = CP.Chain(SMALL, torch.Generator(device=DEV).manual_seed(0), device=DEV)
    tc = TC.TritonChain(chain, 1, quant=(True, False, True))
    with pytest.raises(AssertionError, match="'chain', 1"):
        _check_bits(chain, tc, "chain", ref_quant=(True, True, True))


def test_item_order_follows_the_input_chunks():
    # wo_b-like (no groups): split-major, so the first items read the first chunk
    items = TC._layer_items(128, 512, 1, 128, 4, by_chunk=True)
    assert items[:2] == [(0, 0), (1, 0)] and items[2:4] == [(0, 1), (1, 1)] and len(items) == 8
    # wo_a-like: group g's tiles read columns [g K, (g + 1) K): (group, split) order, then tile
    items = TC._layer_items(256, 256, 2, 128, 2, by_chunk=True)
    assert items == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert TC._layer_items(128, 256, 1, 128, 2, by_chunk=False) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_refuses_what_it_cannot_run():
    gen = torch.Generator(device=DEV).manual_seed(0)
    chain = CP.Chain(((256, 256, 1, 0.0), (256, 128, 4, 0.0)), gen, device=DEV)  # reads 512 of 256
    with pytest.raises(ValueError, match="reads 4 x 128"):
        TC.TritonChain(chain, 1)
    chain = CP.Chain(((256, 256, 1, 0.0),) * 5, gen, device=DEV)
    with pytest.raises(ValueError, match="1..4 layers"):
        TC.TritonChain(chain, 1)
    tc = TC.TritonChain(CP.Chain(SMALL, gen, device=DEV), 1)
    with pytest.raises(ValueError, match="mode"):
        tc.launch("pdl")


def test_max_programs_counts_registers_and_shared_memory():
    class K:
        n_regs = 128

        class metadata:
            shared = 50 * 1024

    assert TC.max_programs(K, 132) == 132 * 4  # 4 warps of 128 registers: 4 CTAs; 50 KB: 4 CTAs
    K.n_regs, K.metadata.shared = 64, 20 * 1024
    assert TC.max_programs(K, 2) == 2 * 8  # registers allow 8, shared memory 10
