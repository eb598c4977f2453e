"""The one-launch CUDA routing (kernels/route_cuda.py) against router.py's Triton launches.

It repeats their operations, so from the same logits it must give router.route's experts and
weights bit for bit and moe_route's grouping and quantized x exactly (integers and exact bf16
values): the GPU tests compare with no tolerance, over one and several routing CTAs (the arrival
counter), hash and top-k layers, ties, both x orders and three calls in a row (the counter
resets itself). The build and the argument list are checked without a GPU."""

import pytest
import torch

from megastep.kernels import route_cuda as RC
from megastep.kernels.cuda_module import find_nvcc
from cuda_checks import assert_builds_without_spills, assert_signature_matches

SCALING = 1.5
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("E", [32, 64, 256, 512])
def test_route_cuda_builds_for_sm90(E):
    assert_builds_without_spills(RC.SOURCE, ("route_group", "gate_route_group"), RC.build_flags(E))


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_route_cuda_needs_its_experts_per_lane():
    from megastep.kernels.cuda_module import CudaUnavailable, build_cubin

    with pytest.raises(CudaUnavailable, match="EXPERTS_PER_LANE"):  # a build without it stops with the reason
        build_cubin(RC.SOURCE)


def test_route_cuda_signature_matches_the_kernel():
    assert RC.kernel_for(256) is RC.kernel_for(256)  # one build per expert count
    assert_signature_matches(RC.SOURCE, RC.kernel_for(256))
    assert_signature_matches(RC.SOURCE, RC.kernel_for(256, "gate_route_group"))


def test_route_cuda_only_on_cuda_and_its_shapes():
    cpu = torch.device("cpu")
    assert not RC.supported(cpu, 256, 4096, 6)
    cuda = torch.device("cuda", 0)
    for E, D, k in ((48, 4096, 6), (1024, 4096, 6), (256, 4000, 6), (256, 4096, 33), (16, 4096, 2)):
        assert not RC.supported(cuda, E, D, k), (E, D, k)  # refused by shape, before looking for nvcc


def _case(B, E, D, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, E, generator=g) * 4
    logits[:, :3] = torch.tensor([25.0, -30.0, 20.0])  # softplus: x > 20 -> x; deep negative; the threshold
    if B > 2:
        logits[2] = 0.0  # a row of equal keys (no bias): the lowest ids win
    bias = torch.randn(E, generator=g) * 0.5 if kind == "bias" else None
    t2e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)]) if kind == "hash" else None
    tokens = torch.randint(0, 50, (B,), generator=g) if kind == "hash" else None
    x = (torch.randn(B, D, generator=g) * 3).bfloat16()
    x[0, :4] = torch.tensor([0.0, -1e-30, 3e4, -448.0])
    cuda = (lambda t: None if t is None else t.cuda())  # noqa: E731
    return tuple(cuda(t) for t in (logits, bias, t2e, tokens, x))


def assert_same_grouping(got, want, permute: bool) -> None:
    """Two moe_route.Routing the same: slots, pairs and quantized x exactly, in the x order asked."""
    n = int(want.nslots)
    assert int(got.nslots) == n and got.permuted == permute and torch.equal(got.pairs, want.pairs)
    for a, b in ((got.slot_expert, want.slot_expert), (got.slot_start, want.slot_start),
                 (got.slot_count, want.slot_count)):
        assert torch.equal(a[:n], b[:n])
    assert torch.equal(got.xq.view(torch.int16), want.xq.view(torch.int16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 3, 8, 9, 16, 42, 64])
@pytest.mark.parametrize("E,D,k,kind", [(256, 4096, 6, "bias"), (256, 4096, 6, "hash"), (64, 512, 4, "plain"),
                                        (32, 1024, 6, "bias")])
def test_gpu_route_cuda_equals_the_triton_launches(B, E, D, k, kind):
    from megastep.kernels.moe_route import moe_route
    from megastep.kernels.router import route

    logits, bias, t2e, tokens, x = _case(B, E, D, k, kind, seed=B * 13 + E)
    want_i, want_w = route(logits, bias, None if t2e is None else t2e[tokens], k, SCALING)
    group = B * k <= RC.MAX_GROUPED_PAIRS
    for call in range(3):
        permute = call % 2 == 1
        i, w, got = RC.route_group(logits, bias, t2e, tokens, k, SCALING, x if group else None, permute=permute)
        assert torch.equal(i, want_i) and torch.equal(w.view(torch.int32), want_w.view(torch.int32))
        if not group:
            assert got is None
            continue
        assert_same_grouping(got, moe_route(want_i, E, x, permute=permute), permute)
    if B > 2 and kind == "plain":  # row 2's equal keys: the lowest ids
        assert torch.equal(i[2].cpu(), torch.arange(k, dtype=torch.int32))


def test_fused_gate_only_where_its_sums_are_the_gate_launch_s(monkeypatch):
    """gate_route_group takes a step only at most FUSED_GATE_ROWS (<= 8) rows, bf16, 16-byte rows and
    the gate's dense configuration of one 128-column block per split (its sums are that launch's)."""
    from megastep.kernels import dense

    monkeypatch.setattr(RC, "supported", lambda *a: True)  # the device and nvcc are not the question here
    x, gate = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(256, 4096, dtype=torch.bfloat16)
    assert not RC.fused_gate_ok(x, gate, 6)  # FUSED_GATE_ROWS 0: off
    monkeypatch.setattr(RC, "FUSED_GATE_ROWS", 8)
    assert RC.fused_gate_ok(x, gate, 6) and RC.fused_gate_ok(torch.zeros(8, 4096, dtype=torch.bfloat16), gate, 6)
    assert not RC.fused_gate_ok(torch.zeros(9, 4096, dtype=torch.bfloat16), gate, 6)  # past one MMA's 8 columns
    monkeypatch.setattr(RC, "FUSED_GATE_ROWS", 2)
    assert not RC.fused_gate_ok(torch.zeros(3, 4096, dtype=torch.bfloat16), gate, 6)
    assert not RC.fused_gate_ok(x.float(), gate, 6) and not RC.fused_gate_ok(x, gate.float(), 6)
    assert not RC.fused_gate_ok(torch.zeros(1, 4100, dtype=torch.bfloat16)[:, :4096], gate, 6)  # rows not 16-byte
    assert not RC.fused_gate_ok(torch.zeros(1, 256, dtype=torch.bfloat16), gate[:32, :256], 6)  # 4 warp tasks
    monkeypatch.setitem(dense._PINNED, (256, 4096), dense.DenseConfig(32, 256, 16, 4, 3))  # 256 columns a split
    assert not RC.fused_gate_ok(x, gate, 6)
    monkeypatch.setitem(dense._PINNED, (256, 4096), dense.DenseConfig(32, 64, 32, 4, 3))  # 128 in two steps
    assert not RC.fused_gate_ok(x, gate, 6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("E,D,k,kind", [(256, 4096, 6, "bias"), (256, 4096, 6, "hash"), (64, 512, 4, "plain")])
def test_gpu_gate_route_group_equals_the_gate_then_the_routing(B, E, D, k, kind, monkeypatch):
    """gate_route_group (the gate GEMV inside the routing's launch) against dense.linear_bf16's gate,
    then route_group: experts, weights, grouping and quantized x bit for bit, three calls in a row (its
    arrival counter resets itself), both x orders, with the special x values of _case."""
    from megastep.kernels import dense

    monkeypatch.setattr(RC, "FUSED_GATE_ROWS", 8)
    _, bias, t2e, tokens, x = _case(B, E, D, k, kind, seed=B * 7 + E)
    gate = (torch.randn(E, D, generator=torch.Generator().manual_seed(B)) * 0.05).bfloat16().cuda()
    gate[:2] = gate[2]  # equal logits of three experts: the ties go to the lowest ids
    assert RC.fused_gate_ok(x, gate, k)
    logits = dense.linear_bf16(x, gate, torch.float32)
    for call in range(3):
        permute = call % 2 == 1
        want_i, want_w, want = RC.route_group(logits, bias, t2e, tokens, k, SCALING, x, permute=permute)
        i, w, got = RC.gate_route_group(x, gate, bias, t2e, tokens, k, SCALING, permute=permute)
        assert torch.equal(i, want_i) and torch.equal(w.view(torch.int32), want_w.view(torch.int32))
        assert_same_grouping(got, want, permute)


@pytest.mark.gpu
@gpu
def test_gpu_gate_route_group_in_a_graph(monkeypatch):
    """Captured in a CUDA graph and replayed on new x: each replay's results are the eager call's."""
    from megastep.kernels import dense

    monkeypatch.setattr(RC, "FUSED_GATE_ROWS", 8)
    _, bias, _, _, x = _case(2, 256, 4096, 6, "bias", seed=3)
    gate = (torch.randn(256, 4096, generator=torch.Generator().manual_seed(9)) * 0.05).bfloat16().cuda()
    xs = x.clone()
    RC.gate_route_group(xs, gate, bias, None, None, 6, SCALING)  # build and load before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = RC.gate_route_group(xs, gate, bias, None, None, 6, SCALING)
    for seed in range(3):
        xs.copy_((torch.randn(2, 4096, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16())
        graph.replay()
        want_i, want_w, _ = RC.route_group(dense.linear_bf16(xs, gate, torch.float32), bias, None, None, 6, SCALING, xs)
        assert torch.equal(out[0], want_i) and torch.equal(out[1].view(torch.int32), want_w.view(torch.int32))
