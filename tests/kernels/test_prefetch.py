"""kernels/prefetch.py (the bulk L2 prefetch a step may launch beside a latency-bound stretch): a
hint that launches nothing on the CPU; it compiles for sm_90 with the bulk prefetch instruction; on
a GPU it runs over V4-sized weights and odd tails, alone and beside a linear in a CUDA graph, and
changes no bit of what reads the weight."""

import os
import subprocess
import sys

import pytest
import torch

from megastep.kernels import linear_fp8 as LIN
from megastep.kernels import prefetch as PF

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_linear_fp8 import make  # noqa: E402


def test_nothing_on_the_cpu():
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    assert PF.prefetch_l2(w) is False
    assert PF.prefetch_l2_ref(w) is False


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megastep.kernels import prefetch as PF
sig = {"p": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "CHUNKS": "constexpr"}
const = {"CHUNK": PF.CHUNK, "CHUNKS": PF.CHUNKS_PER_PROGRAM}
src = ASTSource(fn=PF._l2_prefetch_kernel, signature=sig, constexprs=const, attrs={(0,): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
print(k.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
"""


def test_compiles_for_sm90_with_the_bulk_prefetch():
    """In a process of its own: the test session's kernels are interpreted."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prefetch_changes_no_bits():
    x, w, s = make(1, 8192, 4096, seed=3, dev="cuda")  # 33.5 MB: wo_a's and wo_b's size
    ref = LIN.linear_fp8(x, w, s)
    odd = torch.randn(33 * PF.CHUNK // 2 + 24, device="cuda").bfloat16()  # 33 chunks and 48 bytes
    assert PF.prefetch_l2(w) and PF.prefetch_l2(odd)
    assert not PF.prefetch_l2(odd[1:])  # not 16-byte aligned: nothing
    assert torch.equal(LIN.linear_fp8(x, w, s).view(torch.int16), ref.view(torch.int16))
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # forked onto a stream of its own beside the linear, joined after it
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            PF.prefetch_l2(w)
        y = LIN.linear_fp8(x, w, s)
        main.wait_stream(side)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
