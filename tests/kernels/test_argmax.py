"""kernels/argmax.py against torch.argmax (its reference) bit for bit, under the interpreter on
CPU and on a GPU: ties within and across the kernel's chunks, NaN (either sign), -0 against +0,
+-inf, rows of -inf, a vocabulary that is not a multiple of the chunk, and calls in a row (the
arrival counters reset themselves)."""

import pytest
import torch

from megastep.kernels import argmax as A

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cases(V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    c = A.CHUNK
    x[0, 7] = x[0, c + 3] = x[0].max() + 1  # a tie across chunks: the first wins
    x[1, c + 5] = x[1, c + 9] = x[1].max() + 1  # a tie inside a chunk
    x[2, 2 * c + 1] = float("nan")  # NaN beats every number
    x[2, V - 1] = float("inf")
    x[3, 3] = -float("nan")  # first a NaN with the sign bit set, then one without
    x[3, c - 1] = float("nan")
    x[4] = -x[4].abs() - 1  # all negative, then -0 before +0
    x[4, 11], x[4, V - 2] = -0.0, 0.0
    x[5] = float("-inf")
    x[6, V - 1] = x[6].max() + 1  # the last entry
    x[7, 0] = float("inf")  # the first entry, +inf
    x[8, c:] = x[8].max() + 1  # equal from the second chunk on
    return x


@pytest.mark.parametrize("V", [A.CHUNK * 2 + 1000, 129280])
def test_argmax_rows_equals_torch(V):
    x = cases(V)
    want = A.argmax_rows_ref(x)
    assert x[3, 3].view(torch.int32) < 0  # the sign bit is set
    assert want.tolist()[:6] == [7, cases(V)[1].argmax().item(), 2 * A.CHUNK + 1, 3, 11, 0]  # the cases hold
    xd = x.to(DEV)
    for _ in range(2):  # twice: the counters reset themselves
        assert torch.equal(A.argmax_rows(xd).cpu(), want)
    # a strided view (every other row), and one row
    assert torch.equal(A.argmax_rows(xd[::2]).cpu(), want[::2])
    assert torch.equal(A.argmax_rows(xd[6:7]).cpu(), want[6:7])
    assert A.argmax_rows(xd[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 64])
def test_gpu_argmax_rows_equals_torch_on_the_device(M):
    """The V4 vocabulary on the GPU, against torch's CUDA argmax (what the step ran before): random
    logits with each row's maximum repeated in another chunk, and the edge cases above."""
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 129280, device="cuda", generator=g)
    x[:, 50_000] = x[:, 7] = x.max(dim=-1).values + 1  # a tie across chunks: index 7 wins
    assert torch.equal(A.argmax_rows(x), torch.argmax(x, dim=-1))
    e = cases(129280).cuda()
    assert torch.equal(A.argmax_rows(e), torch.argmax(e, dim=-1))
