"""The built-in default model: the `tiny` synthetic preset with seed 0, with the official tokenizer.

It lets `megastep generate` and `megastep serve` run on a fresh machine without a download. It is
written on first use into the user's cache directory. The directory name carries a version: bump
it whenever the synthetic generator or the tiny preset changes, so that an old cache is not
mistaken for the current model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megastep.checkpoint.synthetic import preset, write_checkpoint

BUILTIN_NAME = "builtin-tiny-v1"
BUILTIN_PRESET = "tiny"
BUILTIN_SEED = 0


def cache_root() -> Path:
    """$XDG_CACHE_HOME/megastep, or ~/.cache/megastep (the XDG default)."""
    # The XDG base-directory variable is the user's standard way to move caches; it carries no
    # megastep knob, so it is read here rather than through config.py.
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megastep"


def builtin_model_dir() -> Path:
    """Directory of the built-in model, writing it first if it is not in the cache yet.

    The checkpoint is written into a private temporary directory next to its final place and then
    renamed; a rename is atomic, so a directory under the final name is always complete, and when
    several processes race on first use, one rename wins and the others drop their copies.
    """
    final = cache_root() / BUILTIN_NAME
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}-", dir=final.parent))
    try:
        write_checkpoint(preset(BUILTIN_PRESET), tmp, BUILTIN_SEED, overwrite=True)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the final directory is ordinary cache
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
