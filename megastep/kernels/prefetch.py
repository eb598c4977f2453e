"""Ask L2 for a weight before it is streamed: a launch that issues Hopper's bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global`, one per 16 KB chunk) over a tensor's bytes and waits for
nothing, run on a stream of its own beside a latency-bound stretch of the step (the mHC, the
attention, the routing), during which HBM idles, so the weight that follows it is read from L2.
It writes nothing: no value depends on it, and its torch twin `prefetch_l2_ref` does nothing.

Shapes and dtypes: any contiguous tensor of a multiple of 16 bytes from a 16-byte aligned address
(the FP8 and BF16 weights at V4 shapes); for another tensor, on the CPU (the interpreter runs no PTX)
or below sm_90, nothing happens: a prefetch is a hint.

Used by FastDecoder's L2_PREFETCH (off: measured slower, fast.L2_PREFETCH says why). Whether it
pays depends on how much faster a linear reads L2 than HBM: the Triton FP8 loop gained 8-17 % with
its whole weight in L2 (docs/PERFORMANCE.md, ninth measurement); the CUDA twin that stages its
weights in shared memory (linear_fp8_staged), with its later waves prefetched, streamed wo_a no
faster than the Triton loop (twenty-eighth measurement).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megastep.kernels.common import on_interpreter

CHUNK = 16 << 10  # bytes per prefetch instruction
CHUNKS_PER_PROGRAM = 32  # one per lane of a 1-warp program


@triton.jit
def _l2_prefetch_kernel(p, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Lane i of program pid asks L2 for chunk pid * CHUNKS + i of [p, p + nbytes) (the last one
    shorter; lanes past the end ask for the first 16 bytes again)."""
    o = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - o, CHUNK)
    ok = size > 0
    o = tl.where(ok, o, 0)
    size = tl.where(ok, size, 16).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [(p + o).to(tl.int64, bitcast=True), size], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def prefetch_l2(t: torch.Tensor) -> bool:
    """Launch the prefetch of t's bytes on the current stream; whether it was launched (see above)."""
    nbytes = t.numel() * t.element_size()
    if on_interpreter(t) or not _hopper(t.device.index) or not t.is_contiguous() or nbytes % 16 or t.data_ptr() % 16 \
            or nbytes == 0:
        return False
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK), CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, CHUNKS=CHUNKS_PER_PROGRAM,
                              num_warps=1)
    return True


def prefetch_l2_ref(t: torch.Tensor) -> bool:
    """The semantics: none (a prefetch changes no value), so nothing is launched."""
    return False
