"""An experiment, not used by the runtime: the gate-up launch of the MXFP4 experts in CUDA C++
(`moe_gate_up_cuda.cu`), a drop-in for `megastep.kernels.moe._moe_gate_up_kernel`.

Why: the routed experts are the largest stage of the step (65 us per layer at batch 1, 78 % of it
at 64 rows) and stream at ~1.1-1.4 TB/s. Two hypotheses it tests (docs/PERFORMANCE.md, seventh
measurement): (1) Triton pipelines only the innermost loop, so each expert's K loop (32 steps of
4 KB per program) starts its weight pipeline anew, and a program that handles several experts
drains and refills it each time; here a prefetch cursor runs 4 steps ahead through all of a
program's experts. (2) Fewer instructions per byte: the MMA operands come straight from 16-byte
loads (no shared memory, no layout conversion); the decode is the same PTX as "dot_asm"
(the same exact values). Counted offline (Triton's cuobjdump, sm_90): ~250-300 instructions per
lane per K step (32 weight bytes a lane, 1 KB a warp) in the straight-line path, i.e. ~250-300
warp-instructions per KB against 346 for "dot_asm"; the decode itself is ~200 of them, so (1) is
the larger hope.

Not yet run on a GPU: `python benchmarks/kernels/moe_cuda_variants.py --out DIR` checks it (the
experts' output against moe_experts_mxfp4_ref, run to run, a row alone against the batch) and
times it against the Triton kernel.

`use_cuda_gate_up()` swaps it in for the Triton gate-up kernel inside `moe_experts_table` (the
same arguments), so everything around it (routing, activation quantization, down, combine) is
the runtime's own. Needs bf16 activations and D a multiple of 128, I of 32.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megastep.kernels import moe as MOE
from megastep.kernels.cuda_module import CudaModule

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_gate_up_cuda.cu")
_MODULE = CudaModule(SOURCE)
_KERNEL = _MODULE.kernel("moe_gate_up_cuda", "pqppppppppqiiqqfiii")
WARPS = 4  # warps per CTA: 32 channels of I, as the Triton kernel's 32-row tiles


class _GateUpShim:
    """Launched as `_moe_gate_up_kernel[grid](...)` is in moe_experts_table; runs the CUDA kernel."""

    def __getitem__(self, grid):
        def launch(xq, addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, D, I, stride_q, sw13, ss13,
                   stride_a, limit, G, TOPK, ROUND_BF16, SPARSE, MODE, **_):
            assert MODE != MOE.MODES["dot_scaled"], "x permuted per 32-group is what this kernel reads"
            assert xq.dtype == torch.bfloat16 and act.dtype == torch.bfloat16, (xq.dtype, act.dtype)
            assert D % 128 == 0 and I % (8 * WARPS) == 0, (D, I)
            _KERNEL.launch((I // (8 * WARPS), G, 1), (32 * WARPS, 1, 1), 0, None,
                           xq, stride_q, addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, stride_a, D, I,
                           sw13, ss13, limit, int(ROUND_BF16), TOPK, int(SPARSE))
        return launch


@contextlib.contextmanager
def use_cuda_gate_up():
    """moe_experts_table launches the CUDA gate-up kernel inside this block."""
    old = MOE._moe_gate_up_kernel
    MOE._moe_gate_up_kernel = _GateUpShim()
    try:
        yield
    finally:
        MOE._moe_gate_up_kernel = old
