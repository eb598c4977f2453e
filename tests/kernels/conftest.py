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
    for name in sorted(loaded, key=lambda n: n != "megastep.kernels.common"):  # shared helpers first
        importlib.reload(sys.modules[name])
