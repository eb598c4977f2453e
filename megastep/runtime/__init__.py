"""Runtime: engines the scheduler drives (engine.py), the scheduler (scheduler.py), the per-bucket
CUDA-graph step runner (step.py), the named step trace (trace.py), expert placement (experts.py),
the CPU sidecar for cold experts (sidecar.py) and expert parallelism across processes
(distributed.py)."""
