"""Instructions per main-loop step of the weight-streaming kernels, counted without a GPU.

    python benchmarks/kernels/sass_loop.py linear --mode f16 [--block-n 64] [--block-m 16] [--block-k 128] [--warps 4] [--codes]
    python benchmarks/kernels/sass_loop.py moe_gate_up [--mode dot_asm] [--block 32]
    python benchmarks/kernels/sass_loop.py moe_down [--mode dot_asm] [--block 64]
    python benchmarks/kernels/sass_loop.py attention [--dv 1]     (the pinned CSA configuration's KV loop)

Compiles the kernel with the installed Triton for sm_90 (H100/H200) on this machine, disassembles
the cubin with the cuobjdump that Triton ships, finds the main loop (the largest loop that holds
no other loop) and prints its instruction count by opcode, the registers and shared memory, and
the warp-instructions issued per KB of weights streamed. Why: at batch 1 these kernels are bound
by instruction issue, not by HBM (docs/PERFORMANCE.md, sixth measurement): an H200 SM receives
~18.6 B per cycle at 4.4 TB/s and issues at most 4 warp-instructions per cycle, so a loop above
~215 warp-instructions per KB cannot reach the HBM roofline whatever its pipelining. Counting them
here ranks kernel variants before any device time is spent. Integer arguments that are multiples
of 16 at run time (strides, sizes) are declared so, as Triton's launcher specializes them.
The count depends on the Triton version: the device runs Triton 3.6. To count what the device
runs, put Triton 3.6 first on the path (`python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install
triton==3.6.0`, then `PYTHONPATH=/tmp/t36/lib/python3.11/site-packages python3 sass_loop.py ...`;
the attention loop differs: 1124 instructions per step under 3.6 whether or not the row
alignment is stated, 3646 under 3.9 without it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megastep.kernels import attention as ATT  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402


def _compile(fn, args: list[tuple[str, str]], const: dict, aligned: set[str], warps: int, stages: int, **options):
    sig = dict(args)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, _) in enumerate(args) if n in aligned or n.endswith("_ptr")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, **options))


def linear(a) -> tuple[object, int]:
    """linear_fp8's kernel at V4 decode tiles; bytes per step: BLOCK_N x BLOCK_K (x2 gated)."""
    names = ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "part_ptr", "cnt_ptr", "res_ptr", "xc_ptr", "xs_ptr",
             "nw_ptr", "qr_ptr", "qc_ptr", "qs_ptr", "cnt2_ptr",
             "M", "N", "K", "K_PER_SPLIT", "limit", "eps", "stride_xm", "stride_wn", "stride_wsn", "stride_om",
             "stride_rm", "stride_cm", "stride_sm", "stride_os", "stride_qr", "stride_qc", "stride_qs"]
    types = ["*bf16", "*fp8e4nv", "*u8", "*bf16", "*fp32", "*i32", "*bf16", "*fp8e4nv", "*fp32"] + \
        ["*fp32", "*bf16", "*fp8e4nv", "*fp32", "*i32"] + ["i32"] * 4 + ["fp32"] * 2 + ["i32"] * 11
    const = dict(MODE=LIN._MODES[a.mode], BLOCK_N=a.block_n, BLOCK_M=a.block_m, BLOCK_K=a.block_k, SPLIT_K=2,
                 OUT_BF16=True, INTERPRET=False, QUANT_ACT=True, GROUP_N=4096, GATED=a.gated, CLAMP=a.gated,
                 HAS_RES=False, CODES=a.codes, PDL=a.pdl, PREFETCH_LINES=4 if a.pdl == 1 else 0, SPLITS_OUT=False,
                 NORM_COLS=0, NORM_BLOCK=128, NORM_FIX=52)
    aligned = {"N", "K", "K_PER_SPLIT", "stride_xm", "stride_wn", "stride_om", "stride_rm", "stride_cm"}
    k = _compile(LIN._linear_fp8_kernel, list(zip(names, types)), const, aligned, a.warps, a.stages)
    return k, a.block_n * a.block_k * (2 if a.gated else 1)


def _moe(a, fn, rows_name: str) -> tuple[object, int]:
    """The experts kernels (dot modes: BLOCK_P 16); bytes per step: 2 x BLOCK_I or BLOCK_D rows x BLOCK_K / 2."""
    if fn is MOE._moe_gate_up_kernel:
        names = ["xq_ptr", "tab_ptr", "rw_ptr", "pair_ptr", "slot_e_ptr", "slot_start_ptr", "slot_cnt_ptr",
                 "nslot_ptr", "act_ptr", "aq_ptr", "qcnt_ptr", "D", "I", "stride_qm", "stride_wn", "stride_sn",
                 "stride_am", "stride_aq", "limit", "G"]
        types = ["*bf16", "*i64", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32", "*bf16", "*bf16", "*i32"] + \
            ["i32"] * 7 + ["fp32", "i32"]
        rows = 2 * a.block
    else:
        names = ["aq_ptr", "tab_ptr", "pair_ptr", "slot_e_ptr", "slot_start_ptr", "slot_cnt_ptr", "nslot_ptr",
                 "y_ptr", "out_ptr", "cnt_ptr", "D", "I", "stride_am", "stride_wn", "stride_sn", "stride_ym",
                 "stride_om", "G"]
        types = ["*bf16", "*i64", "*i32", "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*i32"] + ["i32"] * 8
        rows = a.block
    const = {rows_name: a.block, "TOPK": 6, "BLOCK_P": 16, "BLOCK_K": 128, "ROUND_BF16": True, "INTERPRET": False,
             "MODE": MOE.MODES[a.mode], "ALIGN": 16, "SPARSE": False, "PDL": a.pdl}
    if fn is MOE._moe_down_kernel:
        const["COMBINE"] = True
    else:  # the activation quantization in gate-up's epilogue, as the runtime launches it
        const.update(QUANT=6 <= MOE.FUSED_ACT_QUANT_MAX_PAIRS, NQ=16, PERM=a.mode != "dot_scaled")  # as at batch 1
    aligned = {"D", "I", "stride_qm", "stride_am", "stride_aq", "stride_wn", "stride_sn", "stride_ym", "stride_om"}
    k = _compile(fn, list(zip(names, types)), const, aligned, a.warps, a.stages)
    return k, rows * 64


def attention(a) -> tuple[object, int]:
    """sparse_attention_pools' kernel for V4-Flash CSA (64 heads x 512, 128 + 512 entries, the
    pinned configuration, dv_split from --dv); bytes per step: the BLOCK_N x 512 bf16 KV tile."""
    c = ATT.pick_config(64, 640, 512)
    names = ["q_ptr", "win_ptr", "comp_ptr", "idx_ptr", "ok_ptr", "slot_ptr", "pos_ptr", "rope_ptr", "sink_ptr",
             "out_ptr", "pacc_ptr", "pml_ptr", "cnt_ptr", "H", "W", "WA", "N", "ratio", "scale", "stride_qb",
             "stride_qh", "stride_ws", "stride_wr", "stride_cs", "stride_cr", "stride_ib", "stride_kb", "stride_ob",
             "stride_oh"]
    types = ["*bf16", "*bf16", "*bf16", "*i64", "*u8", "*i64", "*i64", "*fp32", "*fp32", "*bf16", "*fp32", "*fp32",
             "*i32", "i32", "i32", "i32", "i32", "i32", "fp32"] + ["i32"] * 10
    split = -(-640 // c.chunk)
    const = dict(D=512, BLOCK_H=c.block_h, BLOCK_N=c.block_n, CHUNK=c.chunk, SPLIT=split, SPLIT_P2=1 << (split - 1).bit_length(),
                 PIECES=c.pv_pieces, INTERPRET=False, DC=min(512 // a.dv, c.combine_cols), GROUP=min(c.combine_group, split),
                 SRC=3, NOPE_P=224, ROPE_P=32, TABLE=True, DSPLIT=a.dv, ROWS16=True, PDL=0)
    # the ints that are multiples of 16 in the step's launch, which Triton's launcher specializes (W 128,
    # WA, N 640, the top-k rows' strides): without W .. stride_kb the kernel took 139 registers instead
    # of the launch's 114 (benchmarks/kernels/occupancy.py records the launch's own)
    aligned = {"H", "W", "WA", "N", "stride_qb", "stride_qh", "stride_ws", "stride_wr", "stride_cs", "stride_cr",
               "stride_ib", "stride_kb", "stride_ob", "stride_oh"}
    a.warps = c.num_warps
    k = _compile(ATT._sparse_attn_kernel, list(zip(names, types)), const, aligned, c.num_warps, c.num_stages,
                 enable_fp_fusion=False)
    return k, c.block_n * 512 * 2


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each SASS instruction."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*([^;]*);", sass)]


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction index of each loop: a backward branch and its target."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            out.append((at[int(m.group(1), 16)], i))
    return out


def main_loop(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the largest loop that contains no other loop."""
    ins = instructions(sass)
    loops_ = loops(ins)
    inner = [(s, e) for s, e in loops_ if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops_)]
    if not inner:
        raise SystemExit("no loop found in the SASS")
    s, e = max(inner, key=lambda se: se[1] - se[0])
    ops = collections.Counter(re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0] for _, t in ins[s:e + 1])
    return e - s + 1, ops


def cuobjdump(kernel, flag: str) -> str:
    """cuobjdump (Triton's own copy) of the kernel's cubin: "-sass" or "-res-usage"."""
    from triton.backends.nvidia import __file__ as nv

    tool = os.path.join(os.path.dirname(nv), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["linear", "moe_gate_up", "moe_down", "attention"])
    ap.add_argument("--mode", default=None, help="linear: f16 | dot16; moe: a kernels.moe mode (default dot_asm)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-k", type=int, default=128, help="linear: K per loop step")
    ap.add_argument("--block", type=int, default=None, help="moe: BLOCK_I (gate-up, 32) or BLOCK_D (down, 64)")
    ap.add_argument("--gated", action="store_true", help="linear: the shared expert's w1/w3 epilogue")
    ap.add_argument("--codes", action="store_true", help="linear: x's activation codes loaded (x_codes)")
    ap.add_argument("--dv", type=int, default=1, help="attention: programs per value-column split (dv_split)")
    ap.add_argument("--pdl", type=int, default=0, choices=[0, 1, 2, 3],
                    help="the kernels' PDL constexpr (common.PDL_*; 1 = PDL_LATE, with the linear's L2 prefetch of 4 lines)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return ap.parse_args(argv)


def count(a: argparse.Namespace) -> dict:
    """Compile the kernel `a` names and count its main loop."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sass_loop compiles for the GPU: run it without TRITON_INTERPRET=1")
    if a.kernel == "linear":
        a.mode = a.mode or "f16"
        kernel, nbytes = linear(a)
    elif a.kernel == "attention":
        a.mode = f"csa dv{a.dv}"
        kernel, nbytes = attention(a)
    else:
        a.mode = a.mode or "dot_asm"
        up = a.kernel == "moe_gate_up"
        a.block = a.block or (32 if up else 64)
        kernel, nbytes = _moe(a, MOE._moe_gate_up_kernel if up else MOE._moe_down_kernel, "BLOCK_I" if up else "BLOCK_D")
    n, ops = main_loop(cuobjdump(kernel, "-sass"))
    regs = re.search(r"REG:(\d+)", cuobjdump(kernel, "-res-usage"))
    return dict(kernel=a.kernel, mode=a.mode, triton=triton.__version__, registers=int(regs.group(1)) if regs else None,
                shared=kernel.metadata.shared, loop=n, bytes_per_step=nbytes,
                warp_instr_per_kb=n * a.warps * 1024 / nbytes, ops=dict(ops.most_common(16)),
                calls=ops.get("CALL", 0))  # subroutine calls (64-bit division, ...): their instructions are not counted


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    r = count(args)
    if args.json:
        print(json.dumps(r))
        sys.exit(0)
    print(f"{r['kernel']} {r['mode']} (Triton {r['triton']}, sm_90): {r['loop']} instructions per thread per "
          f"step of {r['bytes_per_step']} weight bytes = {r['warp_instr_per_kb']:.0f} warp-instructions per KB; "
          f"shared memory {r['shared']} B, registers {r['registers']}")
    print("  " + ", ".join(f"{k} {v}" for k, v in r["ops"].items()))
