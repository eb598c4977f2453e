"""route against route_ref (FastDecoder._moe's routing): top-k with and without bias and hash
rows, both softplus branches, ties, batch invariance and determinism.

Tolerances (why): the chosen experts must be identical (random logits have no near-ties at the
fp32 ulp level that would let the ulp differences below flip a choice). Weights: the kernel sums
the k chosen scores in ascending expert order, torch in its own reduction order, and exp/log1p
are within an ulp of torch's (the interpreter's float64-rounded vs SLEEF): a few fp32 ulps.
"""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    for _m in ("megastep.kernels.rope_norm", "megastep.kernels.router"):  # imported before the interpreter was set
        if _m in sys.modules:
            importlib.reload(sys.modules[_m])

from megastep.kernels.router import route, route_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALING = 1.5


def make(B, E, seed, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, E, generator=g) * 4
    logits[:, :3] = torch.tensor([25.0, -30.0, 20.0])  # softplus: x > 20 -> x; deep negative; the threshold itself
    bias = torch.randn(E, generator=g) * 0.5
    return logits.to(dev), bias.to(dev)


def check(got, want):
    (i, w), (ir, wr) = got, want
    assert i.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(i.cpu(), ir.cpu())
    assert torch.all(i[:, 1:] >= i[:, :-1])  # ascending
    assert torch.allclose(w.cpu(), wr.cpu(), rtol=4e-7, atol=0), (w - wr).abs().max().item()


@pytest.mark.parametrize("B,E,k", [(1, 32, 4), (3, 256, 6), (5, 20, 3)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_topk_routing(B, E, k, with_bias):
    logits, bias = make(B, E, seed=B * E + k)
    bias = bias if with_bias else None
    out = route(logits, bias, None, k, SCALING)
    check(out, route_ref(logits, bias, None, k, SCALING))
    again = route(logits, bias, None, k, SCALING)
    assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])
    one = route(logits[-1:], bias, None, k, SCALING)
    assert torch.equal(one[0], out[0][-1:]) and torch.equal(one[1], out[1][-1:])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_hash_rows(dtype):
    B, E, k = 4, 256, 6
    logits, _ = make(B, E, seed=3)
    g = torch.Generator().manual_seed(4)
    rows = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)])
    rows[3] = torch.tensor([7, 3, 7, 200, 0, 3])  # duplicates keep their multiplicity, as in torch
    rows = rows.to(dtype).to(DEV)
    check(route(logits, None, rows, k, SCALING), route_ref(logits, None, rows, k, SCALING))


def test_ties_lowest_index_wins():
    """Equal keys: the lowest expert ids are chosen (torch.topk leaves the choice unspecified)."""
    E, k = 64, 6
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(5))
    logits[0, [5, 9, 40, 41, 60, 61, 62, 63]] = 9.0  # 8 equal maxima for 6 places
    logits[1] = 1.0  # everything equal
    logits[2, 10:20] = 7.0
    logits = logits.to(DEV)
    bias = torch.zeros(E, device=DEV)
    idx, w = route(logits, bias, None, k, SCALING)
    # lowest index among equal keys: a stable descending sort
    want = torch.sort(torch.sqrt(torch.nn.functional.softplus(logits.cpu())), dim=-1, descending=True, stable=True).indices[:, :k]
    want = want.sort(-1).values.int()
    assert torch.equal(idx.cpu(), want)
    assert torch.allclose(w[1].cpu(), torch.full((k,), SCALING / k), rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 7, 64])
def test_gpu_v4_shapes(B):
    logits, bias = make(B, 256, seed=B, dev="cuda")
    for b in (bias, None):
        out = route(logits, b, None, 6, SCALING)
        check(out, route_ref(logits, b, None, 6, SCALING))
        one = route(logits[:1], b, None, 6, SCALING)
        assert torch.equal(one[0], out[0][:1]) and torch.equal(one[1], out[1][:1])
    rows = torch.stack([torch.randperm(256, device="cuda")[:6] for _ in range(B)])
    check(route(logits, None, rows, 6, SCALING), route_ref(logits, None, rows, 6, SCALING))


@pytest.mark.parametrize("B,E,k,kind", [(1, 256, 6, "bias"), (3, 256, 6, "hash"), (16, 256, 6, "plain"),
                                        (5, 8, 2, "bias"), (48, 8, 2, "plain")])
@pytest.mark.parametrize("permute", [True, False])
def test_route_group_equals_route_then_moe_route(B, E, k, kind, permute):
    """The fused launch gives route's idx and w bit for bit, and moe_route's grouping and x
    quantization exactly (a launch of either path may serve a step); twice in a row (the arrival
    counter resets itself)."""
    from megastep.kernels.moe_route import moe_route
    from megastep.kernels.router import MAX_GROUPED_PAIRS, route_group, route_group_ref

    assert B * k <= MAX_GROUPED_PAIRS
    logits, bias = make(B, E, seed=B + E)
    g = torch.Generator().manual_seed(B)
    rows = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)]).to(DEV) if kind == "hash" else None
    bias = bias if kind == "bias" else None
    x = (torch.randn(B, 384, generator=g) * 3).to(DEV)
    for xd in (x.bfloat16(), x):
        want_i, want_w = route(logits, bias, rows, k, SCALING)
        want = moe_route(want_i, E, xd, permute=permute)
        for _ in range(2):
            i, w, got = route_group(logits, bias, rows, k, SCALING, xd, permute=permute)
            assert torch.equal(i, want_i) and torch.equal(w.view(torch.int32), want_w.view(torch.int32))
            n = int(want.nslots)
            assert int(got.nslots) == n and got.permuted == permute
            assert torch.equal(got.pairs, want.pairs)
            for a, b in ((got.slot_expert, want.slot_expert), (got.slot_start, want.slot_start),
                         (got.slot_count, want.slot_count)):
                assert torch.equal(a[:n], b[:n])
            assert torch.equal(got.xq.view(torch.int16), want.xq.view(torch.int16))
        # and the torch twin: the same experts, pairs and quantized x; weights as route's (module doc)
        ri, rw, ref = route_group_ref(logits, bias, rows, k, SCALING, xd, permute=permute)
        check((i, w), (ri, rw))
        n = int(ref.nslots)
        assert int(got.nslots) == n and torch.equal(got.pairs.cpu(), ref.pairs.cpu())
        for a, b in ((got.slot_expert, ref.slot_expert), (got.slot_start, ref.slot_start),
                     (got.slot_count, ref.slot_count)):
            assert torch.equal(a[:n].cpu(), b[:n].cpu())
        assert torch.equal(got.xq.cpu().view(torch.int16), ref.xq.cpu().view(torch.int16))


@pytest.mark.parametrize("B,E,D,k,kind", [(1, 256, 512, 6, "bias"), (3, 256, 384, 6, "hash"), (16, 256, 256, 6, "plain"),
                                          (5, 64, 4096, 6, "bias"), (2, 8, 96, 2, "plain"), (2, 256, 4096, 6, "bias")])
def test_gate_route_group_equals_gate_then_route_group(B, E, D, k, kind):
    """The gate GEMV inside the router's launch gives linear_bf16's logits bit for bit (the same
    programs), and then route_group's idx, w, grouping and quantized x exactly; twice in a row
    (both arrival counters reset themselves). D 4096 / E 64: split-K over 16 programs per tile;
    D 96: one split; D 4096 / E 256: V4-Flash's gate (dense.pick_config's rule for it)."""
    from megastep.kernels.dense import linear_bf16
    from megastep.kernels.router import gate_route_group, route_group

    g = torch.Generator().manual_seed(B * 7 + E)
    x = (torch.randn(B, D, generator=g) * 2).bfloat16().to(DEV)
    gw = (torch.randn(E, D, generator=g) * D**-0.5).bfloat16().to(DEV)
    bias = (torch.randn(E, generator=g) * 0.5).to(DEV) if kind == "bias" else None
    rows = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)]).to(DEV) if kind == "hash" else None
    want_logits = linear_bf16(x, gw, torch.float32)
    want_i, want_w, want = route_group(want_logits, bias, rows, k, SCALING, x)
    for _ in range(2):
        i, w, got, logits = gate_route_group(x, gw, bias, rows, k, SCALING)
        assert torch.equal(logits.view(torch.int32), want_logits.view(torch.int32))
        assert torch.equal(i, want_i) and torch.equal(w.view(torch.int32), want_w.view(torch.int32))
        n = int(want.nslots)
        assert int(got.nslots) == n and got.permuted
        assert torch.equal(got.pairs, want.pairs)
        for a, b in ((got.slot_expert, want.slot_expert), (got.slot_start, want.slot_start),
                     (got.slot_count, want.slot_count)):
            assert torch.equal(a[:n], b[:n])
        assert torch.equal(got.xq.view(torch.int16), want.xq.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("kind", ["bias", "hash"])
def test_gpu_gate_route_group_v4_shapes(B, kind):
    """V4-Flash's router (256 experts, D 4096, top-6): the one-launch router gives linear_bf16's
    logits and route_group's results bit for bit on the device, where programs really run
    concurrently (two arrival counters, .cg reads of what other programs wrote); 5 calls in a row."""
    from megastep.kernels.dense import linear_bf16
    from megastep.kernels.router import gate_route_group, route_group

    g = torch.Generator().manual_seed(B + 100)
    x = (torch.randn(B, 4096, generator=g) * 2).bfloat16().cuda()
    gw = (torch.randn(256, 4096, generator=g) / 64).bfloat16().cuda()
    bias = (torch.randn(256, generator=g) * 0.5).cuda() if kind == "bias" else None
    rows = torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(B)]).cuda() if kind == "hash" else None
    want_logits = linear_bf16(x, gw, torch.float32)
    want_i, want_w, want = route_group(want_logits, bias, rows, 6, SCALING, x)
    for _ in range(5):
        i, w, got, logits = gate_route_group(x, gw, bias, rows, 6, SCALING)
        assert torch.equal(logits, want_logits) and torch.equal(i, want_i) and torch.equal(w, want_w)
        n = int(want.nslots)
        assert int(got.nslots) == n and torch.equal(got.pairs, want.pairs)
        assert torch.equal(got.slot_expert[:n], want.slot_expert[:n]) and torch.equal(got.slot_count[:n], want.slot_count[:n])
        assert torch.equal(got.xq, want.xq)


def test_gate_route_group_refuses_more_rows_than_one_tile():
    from megastep.kernels.dense import BLOCK_M
    from megastep.kernels.router import gate_route_group

    B = BLOCK_M + 1
    x = torch.zeros(B, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(AssertionError):
        gate_route_group(x, torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV), None, None, 2, SCALING)


def test_route_group_refuses_too_many_pairs():
    from megastep.kernels.router import MAX_GROUPED_PAIRS, route_group

    B = MAX_GROUPED_PAIRS // 6 + 1
    logits, bias = make(B, 256, seed=1)
    with pytest.raises(AssertionError):
        route_group(logits, bias, None, 6, SCALING, torch.zeros(B, 128, device=DEV))
