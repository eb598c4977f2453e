"""CPU-side compute of the cold-expert sidecar (issue 4, Recipe B). See `experts.py`."""

from megastep.cpu.experts import (
    available_isas,
    backend,
    expert_forward,
    expert_forward_ref,
    experts_forward,
    experts_forward_ref,
)

__all__ = [
    "available_isas",
    "backend",
    "expert_forward",
    "expert_forward_ref",
    "experts_forward",
    "experts_forward_ref",
]
