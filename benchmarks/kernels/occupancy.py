"""How many programs of each Triton launch of a V4-Flash decode step fit an H200 SM, and in how many
waves the launch runs, counted without a GPU.

    python benchmarks/kernels/occupancy.py [--rows 1,2,4,16,64] [--context 4096] [--json FILE]

Why: a launch of P programs with c of them per SM runs in P / (132 c) waves, and a latency-bound
launch whose last wave is partly empty costs a whole program's time for few programs. Counted by
hand, with a kernel compiled apart from the step, CSA's one-row attention seemed such a launch (139
registers, so one 8-warp program per SM and 160 programs in two waves; docs/PERFORMANCE.md,
2026-12-04 evening), but the step's launch has more of its ints specialized (multiples of 16) and
takes 114 registers, two programs per SM, one wave. This counts every launch as the step makes it,
at the V4-Flash shapes.

Two processes, as kernel_lint.py: the first builds a FastDecoder of V4-Flash width with three
layers (sliding window, CSA, HCA; top-k routing in the last two) on the CPU with uninitialized
weights, and runs a step at each row count with every Triton launch recorded and skipped (the
grids and arguments never depend on a kernel's output), the launch options the GPU would take (PDL
for steps of up to FastDecoder.PDL_MAX_ROWS rows, the register caps the interpreter drops); the
second compiles each distinct launch for sm_90 with the installed Triton (the device runs 3.6: put it
first on the path, as sass_loop.py says) and reads its registers and shared memory.
Programs per SM: the least of 32, 64 warps / the program's warps, the 64K registers (a warp takes
its registers per thread rounded up to 8, times 32, rounded up to 256), and 228 KB of shared memory
(each program 1 KB more for the system). The step takes the H200's paths (precompile.gpu_shaped:
the side streams' orders, e.g. a CSA layer's qr group in two launches up to
fast.INDEXER_BESIDE_ROWS rows, and the CUDA C++ experts and routing with the Triton launches around
them). Not counted: those CUDA C++ launches (moe_lut's experts, route_cuda's routing: one CTA per SM
slot by construction), and what runs beside a launch on a second stream.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, HERE)
import kernel_lint as KL  # noqa: E402

SMS = KL.H200_SMS
SM_SHARED = 228 << 10  # shared memory an SM can give its CTAs (sm_90)
CTA_RESERVED = 1 << 10  # what the system keeps of it per CTA
REGS = 65536


def per_sm(warps: int, regs: int, shared: int) -> tuple[int, str]:
    """(programs of `warps` warps, `regs` registers a thread and `shared` bytes of shared memory
    that fit one sm_90 SM at once, what limits them: "ctas", "warps", "regs" or "smem", joined by
    "+" where several do)."""
    warp_regs = math.ceil(math.ceil(regs / 8) * 8 * 32 / 256) * 256
    limits = {"ctas": 32, "warps": 64 // warps, "regs": (REGS // warp_regs) // warps,
              "smem": SM_SHARED // (shared + CTA_RESERVED)}
    n = min(limits.values())
    return n, "+".join(k for k, v in limits.items() if v == n)


def record(rows: list[int], context: int) -> list[dict]:
    """The launches of one step at each row count, in order, each with its row count."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    import torch

    from megastep.bench import _rows

    import precompile

    KL.gpu_launch_options(SMS)
    launches: list[dict] = []
    now = {"rows": 0}
    KL.install_recorders(lambda rec: launches.append({**rec, "rows": now["rows"]}))
    dec = KL.v4_flash_decoder(max(rows), context)
    with precompile.gpu_shaped(dec):
        for r in rows:
            now["rows"] = r
            dec.step(*_rows(torch.device("cpu"), r, context, 1))
    return launches


def resources(recs: list[dict]) -> dict[str, dict]:
    """compile_key -> registers, shared memory and warps of the compiled launch."""
    out = {}
    for r in recs:
        key = KL.compile_key(r)
        if key in out:
            continue
        try:
            k, sass, res = KL.compile_record(r)
            regs = int(re.search(r"REG:(\d+)", res).group(1))
            out[key] = dict(regs=regs, shared=int(k.metadata.shared), warps=int(k.metadata.num_warps),
                            spill_stores=len(re.findall(r"\bSTL\b", sass)))
        except Exception as e:  # noqa: BLE001  (report and go on)
            out[key] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return out


def table(launches: list[dict], res: dict[str, dict]) -> list[dict]:
    """One row per (row count, kernel, grid, compiled launch), in step order, with its count."""
    rows: dict[tuple, dict] = {}
    for r in launches:
        key = KL.compile_key(r)
        k = (r["rows"], f"{r['module']}.{r['kernel']}", tuple(r["grid"]), key)
        if k in rows:
            rows[k]["count"] += 1
            continue
        programs = math.prod(r["grid"])
        row = dict(rows=r["rows"], kernel=k[1], grid=list(r["grid"]), programs=programs, count=1,
                   constexprs={c: v for c, v in r["constexprs"].items() if c.isupper() and c != "INTERPRET"},
                   options=r["options"], **res[key])
        if "error" not in row:
            n, limit = per_sm(row["warps"], row["regs"], row["shared"])
            row.update(per_sm=n, limit=limit, waves=programs / (SMS * n))
        rows[k] = row
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,16,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--json")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.record_only:
        print(json.dumps(record(rows, args.context), default=str))
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("occupancy compiles for the GPU: run it without TRITON_INTERPRET=1")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, "--record-only", "--rows", args.rows, "--context",
                           str(args.context)], env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    launches = json.loads(done.stdout.strip().splitlines()[-1])
    out = table(launches, resources(launches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    import triton

    print(f"Triton {triton.__version__}, sm_90, {SMS} SMs; launches of one step (3 layers: window, CSA, HCA)")
    print(f"{'rows':>4} {'kernel':38} {'n':>2} {'programs':>8} {'w':>2} {'regs':>4} {'STL':>3} {'smem':>6} {'/SM':>3} "
          f"{'limit':10} {'waves':>6}")
    for r in out:
        if "error" in r:
            print(f"{r['rows']:4} {r['kernel']:38} error: {r['error']}")
            continue
        tail = " <- last wave %d %%" % round(100 * (r["waves"] % 1)) if 1 < r["waves"] and r["waves"] % 1 else ""
        print(f"{r['rows']:4} {r['kernel']:38} {r['count']:2} {r['programs']:8} {r['warps']:2} {r['regs']:4} "
              f"{r['spill_stores']:3} {r['shared'] / 1024:5.1f}K {r['per_sm']:3} {r['limit']:10} {r['waves']:6.2f}"
              f"{tail}")


if __name__ == "__main__":
    main()
