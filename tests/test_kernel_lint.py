"""benchmarks/kernels/kernel_lint.py: every Triton kernel a decode step launches, compiled for sm_90
on this CPU machine, calls no subroutine inside a loop. A 64-bit integer division or modulo is
such a call (~100 instructions per element): one in attention's KV loop cost the batch-1 step
ten calls per 32-entry step until 2026-11-29, and this check found it. Runs the script in its own
processes (it records the launches under the interpreter and compiles without it)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kernels", "kernel_lint.py")
NV_BIN = os.path.join(os.path.dirname(importlib.util.find_spec("triton.backends.nvidia").origin), "bin")
if not os.path.exists(os.path.join(NV_BIN, "cuobjdump")):
    pytest.skip("Triton's cuobjdump is not installed", allow_module_level=True)


def test_no_decode_kernel_calls_a_subroutine_in_a_loop(tmp_path):
    out = tmp_path / "lint.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, SCRIPT, "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    kernels = {r["kernel"] for r in rows}
    for k in ("attention._sparse_attn_kernel", "linear_fp8._linear_fp8_kernel", "moe._moe_gate_up_kernel",
              "mhc._hc_finish_kernel", "router._route_group_kernel", "router._gate_route_group_kernel",
              "compressor._compressor_kernel",
              "indexer._select_kernel"):
        assert k in kernels, (k, sorted(kernels))  # the step's kernels were all recorded and compiled
    assert all(r["calls_in_loops"] == 0 for r in rows), [r for r in rows if r["calls_in_loops"]]
