"""kernels/pair_combine.py against its torch twins: the slot-order sum of pair outputs (the bits
of moe.sum_pairs), and the expert-parallel gather with W ranks simulated in one process (each
rank's buffer holds only its own pairs, NaN elsewhere, so a pair read from the wrong rank shows),
the arrival flags it signals, and the layer offsets it applies. The wait on other GPUs' flags runs
in tests/test_distributed_gpu.py."""

import pytest
import torch

from megastep.kernels import moe as MOE
from megastep.kernels import pair_combine as PC
from peer_sim import arrived

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pairs(M, K, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(M, K, D, generator=g) * torch.logspace(-3, 3, D)).to(dtype)
    # awkward values: -0.0 first (the sign of a zero sum), an inf, a subnormal (not in bf16 on the
    # interpreter, whose bf16 -> fp32 conversion flushes it; the GPU's keeps it)
    y[0, 0, 0], y[-1, -1, -1] = -0.0, float("inf")
    if DEV == "cuda" or dtype == torch.float32:
        y[0, -1, 1] = 1e-40
    return y.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K,D", [(1, 6, 100), (3, 2, 1030), (5, 1, 64)])
def test_sum_pairs_same_bits_as_the_loop(M, K, D, dtype):
    y = _pairs(M, K, D, dtype)
    got = PC.sum_pairs(y)
    want = MOE.sum_pairs(y)
    assert got.dtype == torch.float32 and got.shape == (M, D)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("world", [2, 4])
def test_gather_reads_each_pair_from_its_owner(world):
    M, K, D, E, layers, layer = 3, 4, 96, 16, 3, 1
    per = E // world
    g = torch.Generator().manual_seed(world)
    idx = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(M)]).to(DEV)
    y = _pairs(M, K, D, torch.bfloat16, seed=world).view(M * K, D)
    owner = (idx // per).reshape(-1)
    bufs = []
    for r in range(world):  # rank r's per-layer buffers: its pairs at `layer`, NaN wherever it owns nothing
        b = torch.full((layers, M * K, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        b[layer][owner == r] = y[owner == r]
        bufs.append(b)
    flags, epoch, table, ftable = arrived(bufs, layers, layer, 7, DEV)
    for rank in range(world):
        flags[rank + 1 if rank + 1 < world else 0][layer, rank] = 0  # its signal must restore this
        got = PC.gather_sum_pairs(bufs[rank][layer], table, ftable, epoch, idx, layer_off=layer * M * K * D,
                                  flag_off=layer * world, per=per, rank=rank, world_size=world)
        want = PC.gather_sum_pairs_ref([b[layer] for b in bufs], idx, per)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"rank {rank} of {world}"
        assert torch.equal(got.view(torch.int32), MOE.sum_pairs(y.view(M, K, D)).view(torch.int32))
        for f in flags:  # it signalled its arrival at every rank, at this layer only
            assert f[layer, rank] == 7 and not f[0].any() and not f[2].any()
        # with the shared expert's output: w2's residual epilogue, (routed + shared) rounded to its
        # dtype (test_linear_fp8.test_residual_epilogue pins that linear_fp8 computes exactly this)
        for sd in (torch.bfloat16, torch.float32):
            shared = (torch.randn(M, D, generator=g) * 50).to(sd).to(DEV)
            got = PC.gather_sum_pairs(bufs[rank][layer], table, ftable, epoch, idx, layer_off=layer * M * K * D,
                                      flag_off=layer * world, per=per, rank=rank, world_size=world, shared=shared)
            want = PC.gather_sum_pairs_ref([b[layer] for b in bufs], idx, per, shared=shared)
            assert got.dtype == sd and torch.equal(got, want), (rank, sd)
            assert torch.equal(want, (MOE.sum_pairs(y.view(M, K, D)) + shared.float()).to(sd))
