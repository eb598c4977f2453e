"""kernels/split_combine.py and linear_fp8_splits: a linear's split-K partials computed on column
blocks of its weight (as the ranks of a tensor-parallel attention hold wo_b) and summed in split
order give the full launch's bits; the tensor-parallel gather with W ranks simulated in one process
(each rank's buffer holds only its own splits, NaN elsewhere, so a split read from the wrong rank
shows) and the arrival flags it signals. The wait on other GPUs' flags runs in
tests/test_distributed_gpu.py."""

import pytest
import torch

from megastep.kernels import linear_fp8 as LIN
from megastep.kernels import split_combine as SC
from peer_sim import arrived

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _partials(S, M, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(S, M, N, generator=g) * torch.logspace(-3, 3, N)
    p[0, 0, 0], p[-1, -1, -1] = -0.0, float("inf")  # the sign of a zero sum; an inf
    return p.to(DEV)


@pytest.mark.parametrize("od", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("S,M,N", [(1, 1, 64), (4, 3, 1030), (8, 2, 96)])
def test_sum_splits_same_bits_as_the_loop(S, M, N, od):
    p = _partials(S, M, N)
    got = SC.sum_splits(p, od)
    assert got.dtype == od and got.shape == (M, N)
    assert torch.equal(_bits(got), _bits(SC.sum_splits_ref(p, od)))


def _make(M, N, K, seed):
    from megastep.checkpoint import formats as F

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-4, 5, (1, K // 128), generator=g).float()
                                                    ).repeat_interleave(128, 1)
    w, s = F.quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.05, 128)
    return x.to(torch.bfloat16).to(DEV), w.to(DEV), s.to(DEV)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 3])
def test_column_blocks_partials_give_the_full_launchs_bits(world, M, monkeypatch):
    """wo_b split over `world` ranks by columns: each rank's partials (the full launch's
    configuration, 4 splits of 256 columns) concatenated and summed in order give the full
    launch's bits, bf16 and fp32. The partials agree with their torch twin to fp32 order."""
    N, K = 192, 1024
    cfg = LIN.LinearFp8Config("f16", 64, 16, 128, 4)
    monkeypatch.setitem(LIN._PINNED, (N, K, 16), cfg)
    x, w, s = _make(M, N, K, seed=M + world)
    c = LIN.split_cols(K, cfg)
    assert c == 256
    cols = K // world
    parts = [LIN.linear_fp8_splits(x[:, r * cols:(r + 1) * cols], w[:, r * cols:(r + 1) * cols].contiguous(),
                                   s[:, r * cols // 128:(r + 1) * cols // 128].contiguous(), cfg, c)
             for r in range(world)]
    assert all(p.shape == (4 // world, M, N) for p in parts)
    p = torch.cat(parts)
    for od in (torch.bfloat16, torch.float32):
        assert torch.equal(_bits(SC.sum_splits(p, od)), _bits(LIN.linear_fp8(x, w, s, out_dtype=od)))
    ref = LIN.linear_fp8_splits_ref(x, w, s, cfg, c)
    assert ref.shape == p.shape
    torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_partials_of_a_ragged_split_are_refused():
    x, w, s = _make(1, 64, 384, seed=1)
    with pytest.raises(AssertionError, match="whole splits"):
        LIN.linear_fp8_splits(x, w, s, LIN.LinearFp8Config("f16", 64, 16, 128, 2), 256)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_reads_each_split_from_its_owner(world):
    S, M_max, M, N, layers, layer = 8, 4, 3, 96, 3, 1
    per = S // world
    p = _partials(S, M, N, seed=world)
    bufs = []
    for r in range(world):  # rank r's buffers: its splits at `layer`, NaN everywhere else
        b = torch.full((layers, per, M_max, N), float("nan"), device=DEV)
        b[layer, :, :M] = p[r * per:(r + 1) * per]
        bufs.append(b)
    flags, epoch, table, ftable = arrived(bufs, layers, layer, 3, DEV)
    want = SC.sum_splits_ref(p)
    for rank in range(world):
        flags[(rank + 1) % world][layer, rank] = 0  # its signal must restore this
        got = SC.gather_sum_splits(bufs[rank][layer], table, ftable, epoch, M, buf_off=layer * per * M_max * N,
                                   flag_off=layer * world, rank=rank, world_size=world)
        assert got.shape == (M, N) and torch.equal(_bits(got), _bits(want)), f"rank {rank} of {world}"
        for f in flags:  # it signalled its arrival at every rank, at this layer only
            assert f[layer, rank] == 3 and not f[0].any() and not f[2].any()


@pytest.mark.parametrize("world", [2, 3])
def test_gather_cols_puts_every_ranks_columns_in_place(world):
    """The lm head's vocabulary split: every rank's logit columns side by side, read from their
    owner (NaN in the rows past M shows a row read that should not be), after the barrier."""
    M_max, M, NL = 4, 3, 70
    g = torch.Generator().manual_seed(world)
    bufs = [torch.randn(M_max, NL, generator=g).to(DEV) for _ in range(world)]
    for b in bufs:
        b[M:] = float("nan")
    flags, epoch, table, ftable = arrived(bufs, 1, 0, 5, DEV)
    want = SC.gather_cols_ref(bufs, M)
    assert want.shape == (M, world * NL) and not want.isnan().any()
    for rank in range(world):
        flags[(rank + 1) % world][0, rank] = 0  # its signal must restore this
        got = SC.gather_cols(bufs[rank], table, ftable, epoch, M, flag_off=0, rank=rank, world_size=world)
        assert torch.equal(got, want), f"rank {rank} of {world}"
        assert all(f[0, rank] == 5 for f in flags)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 6, 16, 64])
def test_gpu_v4_wo_b_split_over_ranks_gives_the_full_launchs_bits(M):
    """V4-Flash's wo_b (4096 x 8192, pinned in 8 K-splits) as 2 and 4 ranks hold it: every rank's
    partials, concatenated and summed in order, are the full launch's bits (the tensor cores' sums,
    which the interpreter does not have), and the same again on a second run."""
    N, K = 4096, 8192
    x, w, s = _make(M, N, K, seed=M)
    cfg = LIN.pick_config(M, N, K)
    c = LIN.split_cols(K, cfg)
    assert K // c == 8
    whole = LIN.linear_fp8(x, w, s)
    for world in (2, 4):
        cols = K // world
        parts = torch.cat([LIN.linear_fp8_splits(x[:, r * cols:(r + 1) * cols], w[:, r * cols:(r + 1) * cols].contiguous(),
                                                 s[:, r * cols // 128:(r + 1) * cols // 128].contiguous(), cfg, c)
                           for r in range(world)])
        for _ in range(2):
            assert torch.equal(_bits(SC.sum_splits(parts)), _bits(whole)), (M, world)
