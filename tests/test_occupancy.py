"""benchmarks/kernels/occupancy.py's arithmetic: how many programs of a launch fit an sm_90 SM (the
CUDA occupancy rules: registers per thread rounded up to 8, a warp's to 256, 64K a SM; 228 KB of
shared memory with 1 KB more per CTA; 64 warps, 32 CTAs), and the waves of a recorded launch."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kernels"))
import occupancy as OCC  # noqa: E402


def test_programs_per_sm():
    # CSA's one-row attention: 8 warps, 57 KB; 139 registers (as compiled apart) against 114 (the step's launch)
    assert OCC.per_sm(8, 139, 58368) == (1, "regs")  # 144 x 32 = 4608 a warp: 14 warps
    assert OCC.per_sm(8, 114, 58368) == (2, "regs")  # 120 x 32 = 3840: 17 warps
    assert OCC.per_sm(8, 128, 58368) == (2, "regs")  # 4096: 16 warps
    assert OCC.per_sm(4, 96, 58368) == (3, "smem")  # 233472 // 59392
    assert OCC.per_sm(4, 32, 0) == (16, "warps+regs")  # 64 warps; 1024 a warp: 64 warps too
    assert OCC.per_sm(1, 16, 0) == (32, "ctas")
    assert OCC.per_sm(4, 255, 65536) == (2, "regs")  # 256 x 32 = 8192: 8 warps
    assert OCC.per_sm(8, 64, 144 << 10) == (1, "smem")  # 144 KB: 233472 // 148480


def test_table_counts_waves_and_repeats():
    rec = {"module": "attention", "kernel": "_sparse_attn_kernel", "signature": [["q_ptr", "*bf16"]],
           "constexprs": {"CHUNK": 64, "INTERPRET": False}, "options": {"num_warps": 8}, "aligned": []}
    key = OCC.KL.compile_key(rec)
    launches = [{**rec, "grid": [16, 10, 1], "rows": 1}, {**rec, "grid": [16, 10, 1], "rows": 1},
                {**rec, "grid": [64, 10, 4], "rows": 16}]
    rows = OCC.table(launches, {key: {"regs": 139, "shared": 58368, "warps": 8}})
    assert [(r["rows"], r["programs"], r["count"]) for r in rows] == [(1, 160, 2), (16, 2560, 1)]
    assert rows[0]["per_sm"] == 1 and abs(rows[0]["waves"] - 160 / 132) < 1e-12
    assert rows[0]["constexprs"] == {"CHUNK": 64}
    assert abs(rows[1]["waves"] - 2560 / 132) < 1e-12
    err = OCC.table(launches[:1], {key: {"error": "RuntimeError: no"}})
    assert err[0]["error"] == "RuntimeError: no" and "waves" not in err[0]
