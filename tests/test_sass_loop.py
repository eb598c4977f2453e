"""benchmarks/kernels/sass_loop.py: the main-loop instruction counts that the kernel choices rest on
(docs/PERFORMANCE.md, sixth measurement), compiled for sm_90 on this CPU machine."""

import importlib.util
import os
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "kernels", "sass_loop.py")
NV_BIN = os.path.join(os.path.dirname(importlib.util.find_spec("triton.backends.nvidia").origin), "bin")
if not os.path.exists(os.path.join(NV_BIN, "cuobjdump")):
    pytest.skip("Triton's cuobjdump is not installed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(SCRIPT))
spec = importlib.util.spec_from_file_location("sass_loop", SCRIPT)
sass_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loop)


def test_f16_loop_issues_fewer_instructions_than_dot16_and_codes_fewer_still():
    dot16 = sass_loop.count(["linear", "--mode", "dot16"])
    f16 = sass_loop.count(["linear"])
    codes = sass_loop.count(["linear", "--codes"])
    assert dot16["bytes_per_step"] == f16["bytes_per_step"] == 64 * 128
    assert f16["loop"] < 0.8 * dot16["loop"], (f16["loop"], dot16["loop"])
    assert codes["loop"] < 0.9 * f16["loop"], (codes["loop"], f16["loop"])
    assert f16["ops"].get("HGMMA", 0) >= 8 and "FMNMX" not in codes["ops"]  # tensor cores; no amax with codes
    assert f16["registers"] and f16["registers"] <= 255


def test_asm_decode_issues_fewer_instructions_than_the_triton_decode():
    asm = sass_loop.count(["moe_gate_up"])
    dot = sass_loop.count(["moe_gate_up", "--mode", "dot"])
    assert asm["loop"] < 0.7 * dot["loop"], (asm["loop"], dot["loop"])
    assert asm["bytes_per_step"] == dot["bytes_per_step"] == 64 * 64  # 64 rows x 128 K of MXFP4
    assert asm["ops"].get("HGMMA", 0) >= 8
