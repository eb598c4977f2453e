"""Test-wide settings. Tests run on tiny shapes, where torch's intra-op thread pool costs more
than it gains (and competes with other test processes on a 2-core CI machine)."""

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))  # test helpers (hf_compat) import as top-level modules
