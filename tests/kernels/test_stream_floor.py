"""benchmarks/kernels/stream_floor.py: its read-only probe kernels XOR exactly the words the
linear's programs would read (rows pattern, step-contiguous tiles, a TMA descriptor, 64-byte row
segments), so the rates it reports are for the right bytes. Run under the interpreter (--smoke)."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "kernels",
                      "stream_floor.py")


def test_probe_kernels_read_every_word_once(tmp_path):
    out = tmp_path / "floor.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["variant"] for r in rows} == {"rows", "tiled", "tma", "rows64B"}
    assert all(r.get("ok") is True for r in rows), rows
