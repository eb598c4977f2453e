"""linear_fp8_pair (two FP8 linears in one launch, the second reading the first's output) gives
the bits of the two linear_fp8 launches it replaces, and is close to the torch twins."""

import pytest
import torch

from megastep.kernels import linear_fp8 as LIN
from megastep.kernels.linear_pair import linear_fp8_pair, linear_fp8_pair_ref, pair_configs

from test_linear_fp8 import DEV, check, make


def _operands(M, NA, KA, NB, groups, seed, dev=DEV):
    x, wa, sa = make(M, NA, groups * KA, seed, dev=dev)  # x and a [NA, G*KA] weight, cut to [NA, KA]
    wa, sa = wa[:, :KA].contiguous(), sa[:, :KA // 128].contiguous()
    _, wb, sb = make(1, NB, NA, seed + 1, dev=dev)
    return x, wa, sa, wb, sb


def _two_launches(x, wa, sa, wb, sb, groups, qa):
    u = LIN.linear_fp8(x, wa, sa, quantize_act=qa, groups=groups)
    return u, LIN.linear_fp8(u, wb, sb)


# small shapes whose picked configurations split K in both halves (A: 4 splits of 128, B: 2 of 128,
# each B split reading 2 of u's 64-column tiles), grouped or not; M over one and two row tiles
@pytest.mark.parametrize("M", [1, 3, 65])
@pytest.mark.parametrize("groups,qa", [(2, False), (1, True)])
def test_pair_gives_the_bits_of_two_launches(M, groups, qa):
    NA, KA, NB = 256, 512 // groups, 128
    x, wa, sa, wb, sb = _operands(M, NA, KA, NB, groups, seed=M + groups)
    ca, cb = pair_configs(M, NA, KA, NB, qa, True)
    assert ca.split_k > 1 and cb.split_k > 1 and LIN._k_per_split(NA, cb) == 2 * cb.block_n
    want = _two_launches(x, wa, sa, wb, sb, groups, qa)
    for _ in range(2):  # the second launch finds its tickets and counts back at zero
        u, y = linear_fp8_pair(x, wa, sa, wb, sb, groups=groups, quantize_a=qa)
        assert torch.equal(u, want[0]) and torch.equal(y, want[1])
    ru, ry = linear_fp8_pair_ref(x, wa, sa, wb, sb, groups=groups, quantize_a=qa)
    check(u, ru)
    check(y, LIN.linear_fp8_ref(u, wb, sb))  # B against its twin on the same u (u itself may be a step off)


def test_pair_configs_refuse_what_one_launch_cannot_run(monkeypatch):
    # V4-Flash's wo_a / wo_b share tiles, warps and stages at every row tile; B's splits are whole u tiles
    for M in (1, 16, 17, 64):
        ca, cb = pair_configs(M, 8192, 4096, 4096, False, True)
        assert (ca.split_k, cb.split_k) == (4, 8) and ca.block_m == cb.block_m
    # a B whose pinned configuration has other warps cannot join A's launch
    monkeypatch.setitem(LIN._PINNED, (128, 256, 16), LIN.LinearFp8Config("f16", 64, 16, 128, 2, num_warps=8))
    assert pair_configs(1, 256, 256, 128, False, True) is None
    x, wa, sa, wb, sb = _operands(1, 256, 256, 128, 1, seed=3)
    with pytest.raises(AssertionError, match="cannot share a launch"):
        linear_fp8_pair(x, wa, sa, wb, sb, quantize_a=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 2, 4, 16, 17, 64])
def test_gpu_wo_a_wo_b_pair_gives_the_bits_of_two_launches(M):
    """V4-Flash's wo_a (8 groups of 1024 x 4096, bf16 activation) then wo_b (4096 x 8192) in one
    launch, programs really concurrent: u and y bit for bit those of the two launches, five calls
    in a row (the spin waits and the counters' reset), and B within the ref's tolerance."""
    x, wa, sa, wb, sb = _operands(M, 8192, 4096, 4096, 8, seed=M, dev="cuda")
    want = _two_launches(x, wa, sa, wb, sb, 8, False)
    for _ in range(5):
        u, y = linear_fp8_pair(x, wa, sa, wb, sb, groups=8, quantize_a=False)
        torch.cuda.synchronize()
        assert torch.equal(u, want[0]) and torch.equal(y, want[1])
    check(y, LIN.linear_fp8_ref(u, wb, sb))
