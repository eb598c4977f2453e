"""benchmarks/kernels/sass_loop.py: the main-loop instruction counts that the kernel choices rest on
(docs/PERFORMANCE.md, sixth measurement), compiled for sm_90 on this CPU machine. The script runs
in its own process without TRITON_INTERPRET (the test session's kernels are interpreted)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kernels", "sass_loop.py")
NV_BIN = os.path.join(os.path.dirname(importlib.util.find_spec("triton.backends.nvidia").origin), "bin")
if not os.path.exists(os.path.join(NV_BIN, "cuobjdump")):
    pytest.skip("Triton's cuobjdump is not installed", allow_module_level=True)


def count(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, *args, "--json"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_f16_loop_issues_fewer_instructions_than_dot16_and_codes_fewer_still():
    dot16 = count("linear", "--mode", "dot16")
    f16 = count("linear")
    codes = count("linear", "--codes")
    assert dot16["bytes_per_step"] == f16["bytes_per_step"] == 64 * 128
    assert f16["loop"] < 0.8 * dot16["loop"], (f16["loop"], dot16["loop"])
    assert codes["loop"] < 0.9 * f16["loop"], (codes["loop"], f16["loop"])
    assert f16["ops"].get("HGMMA", 0) >= 8 and "FMNMX" not in codes["ops"]  # tensor cores; no amax with codes
    assert f16["registers"] and f16["registers"] <= 255


def test_asm_decode_issues_fewer_instructions_than_the_triton_decode():
    asm = count("moe_gate_up")
    dot = count("moe_gate_up", "--mode", "dot")
    assert asm["loop"] < 0.7 * dot["loop"], (asm["loop"], dot["loop"])
    assert asm["bytes_per_step"] == dot["bytes_per_step"] == 64 * 64  # 64 rows x 128 K of MXFP4
    assert asm["ops"].get("HGMMA", 0) >= 8


def test_attention_kv_loop_divides_nothing():
    """The window entries' ages come from pos % W taken once per program: the KV loop of the CSA
    configuration calls no 64-bit division routine (before: ten ~100-instruction calls per step of
    32 entries), with and without the value split."""
    for dv in ("1", "4"):
        r = count("attention", "--dv", dv)
        assert r["loop"] > 0 and r["calls"] == 0, r  # (the loop's size depends on the Triton version)


def test_refuses_to_run_interpreted():
    out = subprocess.run([sys.executable, SCRIPT, "linear"], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "TRITON_INTERPRET" in out.stderr
