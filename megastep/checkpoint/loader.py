"""Checking and loading a checkpoint directory (config.json + safetensors shards).

Loading happens in two passes. The first reads only config.json, the index and every shard's
header (a few KB each) and compares them with the official table: every problem found anywhere
(directory, config, index, truncated or corrupt shards, missing/unexpected/mistyped tensors) is
reported in one error before a single byte of tensor data is allocated. The second pass reads the
shards one by one through mmap and moves each tensor to its device as it is read, so host memory
never holds more than one tensor beyond what the caller keeps.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megastep.checkpoint.tensors import (
    SAFETENSORS_DTYPES, LazyTensors, TensorSpec, expected_tensors, find_problems, format_problems,
)
from megastep.config import ModelConfig
from megastep.errors import CheckpointError, ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors caps headers at 100 MB; a larger length field means corrupt bytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
LIST_CAP = 20
_ITEMSIZE = {name: dt.itemsize for name, dt in SAFETENSORS_DTYPES.items()}


class CheckpointConfigError(CheckpointError, ConfigError):
    """A checkpoint whose config.json is the problem (missing, invalid, unsupported model):
    both a checkpoint and a config error, so either `except` clause catches it."""


@dataclass
class TensorHeader:
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: list[int]
    nbytes: int


@dataclass
class CheckpointScan:
    """What config.json, the index and the shard headers say, without any tensor data."""

    model_dir: Path
    cfg: ModelConfig | None = None
    config_problem: str | None = None
    shard_files: list[str] = field(default_factory=list)
    headers: dict[str, dict[str, TensorHeader]] = field(default_factory=dict)  # file -> name -> header
    location: dict[str, str] = field(default_factory=dict)  # tensor name -> file holding it
    shards_missing: list[str] = field(default_factory=list)
    unreadable: set[str] = field(default_factory=set)  # names the index puts in bad shards
    problems: list[str] = field(default_factory=list)  # directory, index and shard problems

    @property
    def found(self) -> dict[str, tuple[str, list[int]]]:
        return {n: (self.headers[f][n].dtype, self.headers[f][n].shape) for n, f in self.location.items()}

    def all_problems(self, require_mtp: bool) -> list[str]:
        problems = ([self.config_problem] if self.config_problem else []) + list(self.problems)
        if self.cfg is not None:
            problems += find_problems(self.cfg, self.found, self.shards_missing,
                                      require_mtp=require_mtp, unreadable=self.unreadable)
        elif self.shards_missing:
            problems.append(f"shards listed in {INDEX_FILE} but absent: {', '.join(self.shards_missing)}")
        return problems

    def raise_if_invalid(self, require_mtp: bool) -> None:
        problems = self.all_problems(require_mtp)
        if problems:
            cls = CheckpointConfigError if self.config_problem else CheckpointError
            raise cls(format_problems(f"cannot load the checkpoint in {self.model_dir}", problems))


def _listing(title: str, items: list[str]) -> str:
    more = f"\n      ... and {len(items) - LIST_CAP} more" if len(items) > LIST_CAP else ""
    return f"{title} ({len(items)}):\n      " + "\n      ".join(items[:LIST_CAP]) + more


def read_shard_header(path: Path) -> tuple[dict[str, TensorHeader], str | None]:
    """Parse a safetensors header (8-byte little-endian length + JSON) and check that the file
    holds every byte it promises. Returns (tensors, problem or None)."""
    name = path.name
    size = path.stat().st_size
    if size < 8:
        return {}, f"{name} is truncated: {size} bytes, too short to hold a safetensors header"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or n > size - 8:
            what = "corrupt" if n > MAX_HEADER_BYTES else "truncated or corrupt"
            return {}, f"{name} is {what}: its header length field says {n} bytes, the file has {size}"
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        return {}, f"{name} has a corrupt header (not valid safetensors JSON: {e})"
    tensors: dict[str, TensorHeader] = {}
    bad: list[str] = []
    data_end = 0
    for tname, entry in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(shape)
            if not (type(numel) is int and numel >= 0 and min(shape, default=0) >= 0 and 0 <= begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            bad.append(f"{tname}: malformed header entry {str(entry)[:80]}")
            continue
        item = _ITEMSIZE.get(dtype)
        if item is not None and end - begin != numel * item:
            bad.append(f"{tname}: {dtype} {shape} needs {numel * item} bytes, header gives {end - begin}")
        tensors[tname] = TensorHeader(dtype, shape, end - begin)
        data_end = max(data_end, end)
    if bad:
        return tensors, _listing(f"{name} has a corrupt header", bad)
    if 8 + n + data_end > size:
        return tensors, f"{name} is truncated: {size} bytes, its header needs {8 + n + data_end}"
    return tensors, None


def _read_config(d: Path) -> tuple[ModelConfig | None, str | None]:
    path = d / "config.json"
    if not path.is_file():
        return None, f"no config.json in {d}"
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"config.json is not valid JSON: {e}"
    try:
        return ModelConfig.from_dict(raw), None
    except ConfigError as e:
        return None, str(e)


def _shard_list(d: Path, scan: CheckpointScan) -> dict[str, str] | None:
    """Shard files of the checkpoint; returns the index's weight_map when there is a usable one."""
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to shard file names")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            msg = "has no weight_map" if isinstance(e, KeyError) else f"is not valid: {e}"
            scan.problems.append(f"{INDEX_FILE} {msg}")
            scan.shard_files = sorted(p.name for p in d.glob("*.safetensors"))
            return None
        scan.shard_files = sorted(set(weight_map.values()))
        return weight_map
    if (d / SINGLE_FILE).is_file():
        scan.shard_files = [SINGLE_FILE]
        return None
    scan.problems.append(f"no {INDEX_FILE} or {SINGLE_FILE} in {d}")
    return None


def scan_checkpoint(model_dir: str | Path) -> CheckpointScan:
    """Read config.json, the index and all shard headers; collect every problem found."""
    d = Path(model_dir).expanduser()
    if not d.exists():
        raise CheckpointError(f"model directory {d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a model directory with config.json)")
    scan = CheckpointScan(d)
    scan.cfg, scan.config_problem = _read_config(d)
    weight_map = _shard_list(d, scan)

    for fname in scan.shard_files:
        path = d / fname
        if not path.is_file():
            scan.shards_missing.append(fname)
            continue
        tensors, problem = read_shard_header(path)
        if problem:
            scan.problems.append(problem)
            if not tensors or "corrupt header" in problem:
                continue  # its tensors are unknown; they are accounted for through the index
        scan.headers[fname] = tensors
        dup = [n for n in tensors if n in scan.location]
        if dup:
            scan.problems.append(_listing(f"tensors stored twice ({fname} repeats another shard)", dup))
        for n in tensors:
            scan.location.setdefault(n, fname)

    bad_files = set(scan.shard_files) - set(scan.headers)
    if weight_map is None and bad_files and scan.cfg is not None:
        # No index to say what the bad shards held: everything not found elsewhere is theirs.
        scan.unreadable = set(expected_tensors(scan.cfg)) - set(scan.location)
    if weight_map is not None:
        scan.unreadable = {n for n, f in weight_map.items() if f in bad_files and n not in scan.location}
        wrong = [f"{n} -> {f}" for n, f in weight_map.items()
                 if f in scan.headers and n not in scan.headers[f]]
        unlisted = [n for n in scan.location if n not in weight_map]
        if wrong:
            scan.problems.append(_listing(f"{INDEX_FILE} places tensors in shards that do not hold them", wrong))
        if unlisted:
            scan.problems.append(_listing(f"tensors in the shards that {INDEX_FILE} does not list", unlisted))
    return scan


def load_checkpoint(model_dir: str | Path, device: str | torch.device = "cpu", include_mtp: bool = False,
                    progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Validate the whole checkpoint from its headers, then load it shard by shard onto `device`.

    Tensors keep their stored dtypes (an unquantized export may be BF16 or F32). MTP tensors are
    validated when present but only loaded with include_mtp (which also makes them required).
    """
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    scan = scan_checkpoint(model_dir)
    scan.raise_if_invalid(require_mtp=include_mtp)
    cfg = scan.cfg
    assert cfg is not None
    order = [n for n in expected_tensors(cfg, include_mtp=include_mtp) if n in scan.location]
    by_file: dict[str, list[str]] = {}
    for n in order:
        by_file.setdefault(scan.location[n], []).append(n)
    total = sum(scan.headers[scan.location[n]][n].nbytes for n in order)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading",
               disable=not progress or not sys.stderr.isatty())
    loaded: dict[str, torch.Tensor] = {}
    device = torch.device(device)
    for fname in scan.shard_files:
        names = by_file.get(fname)
        if not names:
            continue
        try:
            with safe_open(str(scan.model_dir / fname), framework="pt", device="cpu") as f:
                for n in names:
                    loaded[n] = f.get_tensor(n).to(device)
                    bar.update(scan.headers[fname][n].nbytes)
        except (SafetensorError, OSError) as e:
            bar.close()
            raise CheckpointError(f"cannot read {scan.model_dir / fname}: {e}") from None
    bar.close()
    return cfg, {n: loaded[n] for n in order}


class LazyCheckpoint(LazyTensors):
    """A validated checkpoint's tensors, each read from its shard (mmap) and moved to `device` on
    first access: with a consumer that builds a layer and then deletes that layer's names
    (FastDecoder with consume=True), neither host nor device memory ever holds more than about
    one layer of raw tensors. This is how a model larger than device memory loads when its
    placement sends the cold experts to host memory."""

    def __init__(self, scan: CheckpointScan, names: list[str], device: torch.device):
        super().__init__(names)
        self.scan, self.device = scan, device
        self._files: dict[str, object] = {}

    def nbytes(self) -> dict[str, int]:
        return {n: self.scan.headers[self.scan.location[n]][n].nbytes for n in self}

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        fname = self.scan.location[name]
        try:
            f = self._files.get(fname)
            if f is None:
                f = self._files[fname] = safe_open(str(self.scan.model_dir / fname), framework="pt", device="cpu")
            return f.get_tensor(name).to(self.device)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {self.scan.model_dir / fname}: {e}") from None


def open_checkpoint(model_dir: str | Path, device: str | torch.device = "cpu",
                    include_mtp: bool = False) -> tuple[ModelConfig, LazyCheckpoint]:
    """Validate the whole checkpoint from its headers (as load_checkpoint), then return a mapping
    that reads each tensor when it is first accessed (each access reads it again: consumers take
    a tensor once)."""
    scan = scan_checkpoint(model_dir)
    scan.raise_if_invalid(require_mtp=include_mtp)
    cfg = scan.cfg
    assert cfg is not None
    names = [n for n in expected_tensors(cfg, include_mtp=include_mtp) if n in scan.location]
    return cfg, LazyCheckpoint(scan, names, torch.device(device))


# ---- inspect -------------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _layer_list(layers: list[int]) -> str:
    if not layers:
        return "none"
    if len(layers) > 3:
        step = layers[1] - layers[0]
        if all(b - a == step for a, b in zip(layers, layers[1:])):
            return f"{layers[0]}-{layers[-1]}" + (f" step {step}" if step > 1 else "")
    return ", ".join(map(str, layers))


_MTP_RE = re.compile(r"^mtp\.\d+\.")


def describe_plan(model_dir: str | Path) -> str:
    """What `megastep inspect DIR` prints: layers by kind, parameter bytes by dtype and role,
    per-sequence state, totals, and any problems; built from headers only (no tensor data)."""
    scan = scan_checkpoint(model_dir)
    cfg = scan.cfg
    if cfg is None:
        scan.raise_if_invalid(require_mtp=False)
    assert cfg is not None
    L = cfg.num_hidden_layers
    kinds: dict[str, list[int]] = {"sliding": [], "csa": [], "hca": []}
    for i in range(L):
        kinds[cfg.layer_kind(i)].append(i)
    hash_layers = [i for i in range(L) if cfg.is_hash_layer(i)]
    q = cfg.quantization_config
    quant = (f"FP8 e4m3 {q.weight_block_size[0]}x{q.weight_block_size[1]} blocks, experts {cfg.expert_dtype or 'fp8'}"
             if q else "unquantized")
    lines = [
        f"DeepSeek-V4 checkpoint {scan.model_dir}",
        f"  model: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {L} layers + {cfg.num_nextn_predict_layers} MTP, "
        f"{cfg.num_attention_heads} heads x {cfg.head_dim}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}; {quant}",
        "  attention: " + "; ".join(f"{k} {len(v)} ({_layer_list(v)})" for k, v in kinds.items() if v),
        f"  MoE routing: hash {len(hash_layers)} ({_layer_list(hash_layers)}), "
        f"score {L - len(hash_layers)} ({_layer_list([i for i in range(L) if not cfg.is_hash_layer(i)])})",
    ]
    table: dict[str, TensorSpec] = expected_tensors(cfg, include_mtp=True)
    by_dtype: dict[str, int] = {}
    by_role: dict[str, int] = {}
    main = mtp = 0
    for n, f in scan.location.items():
        h = scan.headers[f][n]
        by_dtype[h.dtype] = by_dtype.get(h.dtype, 0) + h.nbytes
        if _MTP_RE.match(n):
            mtp += h.nbytes
            continue
        main += h.nbytes
        role = table[n].role if n in table else "unexpected"
        by_role[role] = by_role.get(role, 0) + h.nbytes
    n_shards = len(scan.shard_files)
    lines.append(f"  tensors: {len(scan.location)} in {n_shards} shard{'s' * (n_shards != 1)}, "
                 f"{_bytes(main + mtp)} ({_bytes(main)} main model, {_bytes(mtp)} MTP)")
    lines.append("  by dtype: " + ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1])))
    lines.append("  by role (main model): " + ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(by_role.items(), key=lambda kv: -kv[1])))
    per_tok = cfg.state_bytes_per_token()
    fixed = cfg.state_bytes_fixed()
    ctx = cfg.max_position_embeddings
    slot = fixed + per_tok * ctx
    lines.append(f"  state per sequence: {_bytes(per_tok)} per token of context + {_bytes(fixed)} fixed "
                 f"(window rings, compressor buffers); one slot at {ctx} tokens: {_bytes(slot)}")
    lines.append(f"  total: {_bytes(main)} main-model weights + {_bytes(slot)} per full-context slot")
    problems = scan.all_problems(require_mtp=False)
    lines.append("  check: OK" if not problems else "  " + format_problems("check", problems).replace("\n", "\n  "))
    return "\n".join(lines)
