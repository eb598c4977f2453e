"""`megastep bench` with the "lut" experts kernels built with extra nvcc flags (the experiment
switches of kernels/moe_lut.cu), to time a switch end to end before making it the default.

    python benchmarks/kernels/bench_lut_flags.py "-DDECODE_B_ALU=1" --preset v4-flash --layers 30 --batch 1,4
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megastep import cli  # noqa: E402
from megastep.kernels import moe_lut as LUTK  # noqa: E402
from megastep.kernels.cuda_module import CudaModule  # noqa: E402


def main() -> int:
    flags = tuple(sys.argv[1].split())
    mod = CudaModule(LUTK.SOURCE, extra_flags=flags)
    LUTK._GATE_UP = mod.kernel("moe_gate_up_lut", LUTK._GATE_UP.signature)
    LUTK._DOWN = mod.kernel("moe_down_lut", LUTK._DOWN.signature)
    print(f"lut kernels built with {' '.join(flags)}", flush=True)
    return cli.main(["bench", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
