"""benchmarks/kernels/linear_chain.py (a probe): a chain of FP8 linears in one persistent launch. Every layer's output
has linear_fp8's bits (fp32 and bf16 outputs, with and without the activation quantization, grouped
layers, 1 and 3 rows), in one launch and a launch a layer, and is near linear_chain_ref; the counters are
back at zero after each launch; the item order and what it refuses; chain_probe.py's wrapper of it. On the
CPU through the interpreter with one program (programs run one after another there), on the GPU with
two and four per SM."""

import os
import sys

import pytest
import torch

from megastep.kernels import linear_fp8 as LIN

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks", "kernels"))

import linear_chain as LC  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROGRAMS = [1] if DEV == "cpu" else [None, 4 * torch.cuda.get_device_properties(0).multi_processor_count]


def _chain(shapes, quant, out_dtype, seed=0):
    """shapes: (N, K, G) per layer."""
    import bench_kernels as BK

    g = torch.Generator(device=DEV).manual_seed(seed)
    return [LC.ChainLayer(*BK.fp8_weight(N, K, g, DEV), G, q, out_dtype) for (N, K, G), q in zip(shapes, quant)]


# a split layer, a grouped layer reading the first 256 outputs, a layer of 4 splits
SMALL = ((256, 256, 1), (512, 128, 2), (128, 512, 1))
# the step's wo_a -> wo_b in small: grouped and unquantized bf16, then quantized
WO = ((512, 256, 2), (256, 512, 1))


def _check(lc, layers, x, mode, ref_quant=None):
    ys = lc(x, mode=mode)
    xin = x
    for i, (ly, y) in enumerate(zip(layers, ys)):
        G, K = ly.groups, ly.w.shape[1]
        ref = LIN.linear_fp8(xin[:, :G * K].contiguous(), ly.w, ly.scale, out_dtype=ly.out_dtype, groups=G,
                             quantize_act=(ref_quant or [ly.quantize_act for ly in layers])[i])
        assert torch.equal(ref, y), (mode, i, int((ref != y).sum()))
        xin = y
    assert lc.exit.tolist() == [0, 0]  # the programs-out count reset, no wait gave up
    assert not lc.chunks.any() and not any(c.any() for c in lc.tile_cnt)
    return ys


@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("shapes,quant,dtype,rows", [
    (SMALL, (True, True, True), torch.float32, 1),
    (SMALL, (True, False, True), torch.float32, 1),
    (WO, (False, True), torch.bfloat16, 1),
    (WO, (False, True), torch.bfloat16, 3),
])
def test_chain_has_linear_fp8s_bits(programs, shapes, quant, dtype, rows):
    layers = _chain(shapes, quant, dtype)
    lc = LC.LinearChain(layers, programs)
    assert [(p["kps"], p["splits"]) for p in lc.params][:2] == ([(128, 2), (128, 1)] if shapes is SMALL else
                                                                 [(128, 2), (128, 4)])
    x = torch.randn(rows, shapes[0][2] * shapes[0][1], device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    x = x.to(dtype)
    for mode in ("chain", "sep", "chain"):
        ys = _check(lc, layers, x, mode)
    for y, r in zip(ys, LC.linear_chain_ref(x, layers)):  # and near the torch ref (one bf16 step)
        assert torch.allclose(y.float(), r.float(), rtol=1e-2, atol=1e-2 * r.float().abs().max().item())


def test_check_can_fail():
    """The bit check fails when one layer's arithmetic differs from the reference's: the grouped layer run
    without its activation quantization, checked against linear_fp8 with it."""
    layers = _chain(SMALL, (True, False, True), torch.float32)
    lc = LC.LinearChain(layers, 1 if DEV == "cpu" else None)
    x = torch.randn(1, 256, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    with pytest.raises(AssertionError, match="'chain', 1"):
        _check(lc, layers, x, "chain", ref_quant=[True, True, True])


@pytest.mark.skipif(DEV == "cpu", reason="the gaps spin on the GPU's global timer")
def test_gpu_gaps_and_many_programs_keep_the_bits():
    layers = _chain(SMALL, (True, True, True), torch.float32)
    lc = LC.LinearChain(layers, 4 * torch.cuda.get_device_properties(0).multi_processor_count)
    x = torch.randn(1, 256, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    ref = _check(lc, layers, x, "sep")
    for _ in range(3):
        ys = lc(x, gaps_ns=[0, 2000, 1000])
        assert all(torch.equal(a, b) for a, b in zip(ref, ys))
    lc.check()


def test_item_order_follows_the_input_chunks():
    # wo_b-like (no groups): split-major, so the first items read the first chunk
    items = LC._layer_items(128, 512, 1, 128, 4, by_chunk=True)
    assert items[:2] == [(0, 0), (1, 0)] and items[2:4] == [(0, 1), (1, 1)] and len(items) == 8
    # wo_a-like: group g's tiles read columns [g K, (g + 1) K): (group, split) order, then tile
    items = LC._layer_items(256, 256, 2, 128, 2, by_chunk=True)
    assert items == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert LC._layer_items(128, 256, 1, 128, 2, by_chunk=False) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="reads 4 x 128"):
        LC.plan(_chain(((256, 256, 1), (512, 128, 4)), (True, True), torch.float32))
    with pytest.raises(ValueError, match="1..4 layers"):
        LC.plan(_chain(((256, 256, 1),) * 5, (True,) * 5, torch.float32))
    lc = LC.LinearChain(_chain(WO, (False, True), torch.bfloat16), 1)
    x = torch.zeros(17, 512, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="1..16 rows"):
        lc(x)
    with pytest.raises(ValueError, match="1..16 rows"):
        lc(x[:1, :100])
    with pytest.raises(ValueError, match="mode"):
        lc(x[:1], mode="pdl")


def test_max_programs_counts_registers_and_shared_memory():
    class K:
        n_regs = 128

        class metadata:
            shared = 50 * 1024

    assert LC.max_programs(K, 132) == 132 * 4  # 4 warps of 128 registers: 4 CTAs; 50 KB: 4 CTAs
    K.n_regs, K.metadata.shared = 64, 20 * 1024
    assert LC.max_programs(K, 2) == 2 * 8  # registers allow 8, shared memory 10


def test_chain_probe_wrapper_runs_the_chain():
    import chain_probe as CP
    import triton_chain as TC

    chain = CP.Chain(((256, 256, 1, 0.0), (512, 128, 2, 1.0)), torch.Generator(device=DEV).manual_seed(0),
                     device=DEV)
    tc = TC.TritonChain(chain, 1 if DEV == "cpu" else 264)
    for mode in ("chain", "sep"):
        for y in chain.ys:
            y.fill_(float("nan"))
        tc.launch(mode)
        for i, ly in enumerate(chain.layers):
            ref = LIN.linear_fp8(chain.x(i), ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G)[0]
            assert torch.equal(ref, chain.ys[i]), (mode, i)
