"""Runtime: the engine the scheduler drives (engine.py) and the scheduler itself (scheduler.py)."""
