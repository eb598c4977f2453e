"""Kernel tests run on the GPU when there is one, else on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before `@triton.jit` decorates the kernels, i.e. before the kernel
modules are imported; a module imported earlier (by another test package) is reloaded."""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    loaded = [n for n in sys.modules if n.startswith("megastep.kernels.")]
    # modules whose @triton.jit functions other kernel modules import come first
    helpers = ["megastep.kernels.common", "megastep.kernels.rope_norm", "megastep.kernels.expert_table",
               "megastep.kernels.moe_route"]
    for name in sorted(loaded, key=lambda n: helpers.index(n) if n in helpers else len(helpers)):
        importlib.reload(sys.modules[name])
