"""Where the routed experts' weights live, as the MXFP4 experts kernels (`kernels/moe.py`) see
them: an address table.

An `ExpertTable` holds, for each expert of a layer, the base addresses of its four tensors
(w13 int8 [2I, D/2], w13_scale e8m0 [2I, D/32], w2 int8 [D, I/2], w2_scale e8m0 [D, I/32]) in an
int64 [E, 4] tensor on the kernels' device; the kernels load an expert's pointers from it
(`_expert_ptr`). So experts may live anywhere the GPU can address: stacked [E, ...] tensors
(`stack_experts`, `ExpertTable.from_stacked`), separate device allocations, or page-locked host
memory read "zero-copy" through its device-visible address under unified virtual addressing
(`ExpertTable.from_experts`: a placement's cold experts). Row strides are common to all experts
of a table, so the kernels take them as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

SCALE_MIN, SCALE_MAX = 2, 240  # E8M0 bytes every MXFP4 decode mode handles exactly (kernels/moe.py)


def _align(values: Sequence[int]) -> int:
    """Largest power of two <= 16 dividing every value (the kernels' pointer-alignment hint)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    return 16 if g == 0 else min(16, g & -g)


def _expert_shapes(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> tuple[int, int]:
    """Checks one expert's (or, with a leading E dim, every expert's) tensors -> (D, I)."""
    two_i, dh = w13.shape[-2:]
    I, D = two_i // 2, dh * 2
    assert two_i == 2 * I and D % 32 == 0 and I % 32 == 0, (w13.shape, D, I)
    assert s13.shape[-2:] == (2 * I, D // 32) and w2.shape[-2:] == (D, I // 2) and s2.shape[-2:] == (D, I // 32), (
        w13.shape, s13.shape, w2.shape, s2.shape)
    assert w13.dtype in (torch.int8, torch.uint8) and w2.dtype in (torch.int8, torch.uint8), (w13.dtype, w2.dtype)
    for s in (s13, s2):
        assert s.dtype in (torch.float8_e8m0fnu, torch.uint8), s.dtype
    for t in (w13, s13, w2, s2):
        assert t.stride(-1) == 1, t.stride()
    return D, I


def _device(d: torch.device | str) -> torch.device:
    """"cuda" -> "cuda:<current>" (tensors report an index; comparisons need one)."""
    d = torch.device(d)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def _reachable(t: torch.Tensor, device: torch.device) -> None:
    """A kernel on `device` reads t: t lives there, or in pinned host memory (device-visible
    address under unified virtual addressing) when device is a GPU."""
    ok = t.device == device or (device.type == "cuda" and t.device.type == "cpu" and t.is_pinned())
    assert ok, f"expert tensor on {t.device} (pinned={t.device.type == 'cpu' and t.is_pinned()}) not readable from {device}"


def check_scales(*scales: torch.Tensor) -> None:
    """Raises ValueError unless every E8M0 byte is in [SCALE_MIN, SCALE_MAX] (load-time check:
    reads every byte once and synchronizes)."""
    for s in scales:
        u = s.view(torch.uint8)
        lo, hi = int(u.min()), int(u.max())
        if lo < SCALE_MIN or hi > SCALE_MAX:
            raise ValueError(f"MXFP4 scale bytes {lo}..{hi} outside the supported {SCALE_MIN}..{SCALE_MAX} "
                             f"(2^{SCALE_MIN - 127}..2^{SCALE_MAX - 127})")


@dataclass(frozen=True, eq=False)
class ExpertTable:
    """Where each expert's four tensors live: addr int64 [E, 4] on the kernels' device holds the
    base addresses of (w13, w13_scale, w2, w2_scale) of every expert; the shapes (from D, I) and
    the row strides in bytes are common to all experts. `tensors` keeps what the addresses point
    into alive (empty for the wrapper's cached tables of stacked tensors, whose caller owns them)."""

    addr: torch.Tensor
    D: int
    I: int
    strides: tuple[int, int, int, int]  # row strides (bytes) of w13, w13_scale, w2, w2_scale
    align: int  # largest power of two <= 16 dividing every address (a load-vectorization hint)
    tensors: tuple = ()
    sparse: bool = False  # some experts are absent (address 0: another rank holds them)

    @property
    def E(self) -> int:
        return self.addr.shape[0]

    @property
    def device(self) -> torch.device:
        return self.addr.device

    @classmethod
    def from_stacked(cls, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                     device: torch.device | str | None = None, keep: bool = True) -> ExpertTable:
        """Stacked [E, ...] tensors (module doc). The addresses are computed with device ops
        (base + e * stride), so this also works inside CUDA-graph capture (where the table is
        valid only in the captured stream order)."""
        dev = _device(device) if device is not None else w13.device
        ts = (w13, w13_scale, w2, w2_scale)
        D, I = _expert_shapes(*ts)
        E = w13.shape[0]
        assert all(t.dim() == 3 and t.shape[0] == E for t in ts), [t.shape for t in ts]
        for t in ts:
            _reachable(t, dev)
        ar = torch.arange(E, dtype=torch.int64, device=dev)
        addr = torch.stack([ar * t.stride(0) + t.data_ptr() for t in ts], dim=1)
        align = _align([t.data_ptr() for t in ts] + [t.stride(0) for t in ts])
        return cls(addr, D, I, tuple(t.stride(1) for t in ts), align, ts if keep else ())

    @classmethod
    def from_experts(cls, experts: Sequence[Sequence[torch.Tensor] | None],
                     device: torch.device | str | None = None) -> ExpertTable:
        """experts[e] = (w13 [2I, D/2], w13_scale [2I, D/32], w2 [D, I/2], w2_scale [D, I/32]), each
        its own allocation anywhere the kernels' device can read (on a GPU: its memory or pinned
        host memory), or None for an expert this process does not hold (expert parallelism: its
        addresses are 0 and the kernels skip it, `sparse`). device defaults to the first CUDA
        tensor's device, else the CPU. Builds the table on the host and copies it (not inside
        CUDA-graph capture)."""
        held = [ex for ex in experts if ex is not None]
        assert len(held) > 0, "a table needs at least one expert"
        if device is None:
            device = next((t.device for ex in held for t in ex if t.is_cuda), torch.device("cpu"))
        dev = _device(device)
        shapes = _expert_shapes(*held[0])
        strides = tuple(t.stride(0) for t in held[0])
        rows = []
        for ex in experts:
            if ex is None:
                rows.append([0, 0, 0, 0])
                continue
            assert len(ex) == 4 and _expert_shapes(*ex) == shapes, [t.shape for t in ex]
            assert tuple(t.stride(0) for t in ex) == strides, "row strides must be common to all experts"
            for t in ex:
                _reachable(t, dev)
            rows.append([t.data_ptr() for t in ex])
        addr = torch.tensor(rows, dtype=torch.int64).to(dev)
        align = _align([a for r in rows for a in r if a])  # row strides are kernel arguments: specialized apart
        return cls(addr, shapes[0], shapes[1], strides, align, tuple(tuple(ex) if ex is not None else None for ex in experts),
                   sparse=len(held) < len(experts))

    def check_scales(self) -> None:
        """check_scales over every scale tensor this table keeps (load time)."""
        if self.tensors and not isinstance(self.tensors[0], torch.Tensor):  # per expert (None: absent)
            groups = tuple(ex for ex in self.tensors if ex is not None)
        else:
            groups = (self.tensors,)
        check_scales(*[ex[j] for ex in groups if ex for j in (1, 3)])


_STACKED_TABLES: dict[tuple, ExpertTable] = {}


def stacked_table(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> ExpertTable:
    """ExpertTable.from_stacked, cached by (device, address, shape, stride) of the four tensors:
    a dict lookup per call. The table holds addresses only, so it is right for any tensors with
    that key (a freed tensor's address reused by an identical one gives the same table). Tables
    built during CUDA-graph capture are not cached (their values exist only in the graph)."""
    ts = (w13, w13_scale, w2, w2_scale)
    key = (str(w13.device),) + tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in ts)
    tab = _STACKED_TABLES.get(key)
    if tab is None:
        tab = ExpertTable.from_stacked(*ts, keep=False)
        if not (w13.is_cuda and torch.cuda.is_current_stream_capturing()):
            _STACKED_TABLES[key] = tab
    return tab


@triton.jit
def _expert_ptr(tab_ptr, e, j: tl.constexpr, ALIGN: tl.constexpr):
    """Base pointer (uint8) of tensor j of expert e, from the address table."""
    p = tl.load(tab_ptr + e * 4 + j).to(tl.pointer_type(tl.uint8))
    if ALIGN > 1:  # lets the compiler vectorize the loads (it cannot know a loaded address)
        p = tl.multiple_of(p, ALIGN)
    return p




def stack_experts(weights: dict[str, torch.Tensor], layer_prefix: str, E: int,
                  ids: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Official per-expert tensors `{layer_prefix}.ffn.experts.{e}.w{1,2,3}.{weight,scale}` ->
    {"w13", "w13_scale", "w2", "w2_scale"} stacked as `moe_experts_mxfp4` takes them (done once
    at load). `layer_prefix` is e.g. "layers.3". ids: stack only these experts, in this order
    (expert parallelism: a rank's own experts); default all E."""
    p = layer_prefix.rstrip(".") + ".ffn.experts."
    ids = list(range(E)) if ids is None else list(ids)

    def raw(e: int, name: str) -> torch.Tensor:  # E8M0 as its bytes: cat/stack need not know it
        v = weights[f"{p}{e}.{name}"]
        return v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v

    def like(stacked: torch.Tensor, name: str) -> torch.Tensor:
        return stacked.view(weights[f"{p}{ids[0]}.{name}"].dtype)

    return {
        "w13": torch.stack([torch.cat([raw(e, "w1.weight"), raw(e, "w3.weight")], 0) for e in ids]),
        "w13_scale": like(torch.stack([torch.cat([raw(e, "w1.scale"), raw(e, "w3.scale")], 0) for e in ids]), "w1.scale"),
        "w2": torch.stack([raw(e, "w2.weight") for e in ids]),
        "w2_scale": like(torch.stack([raw(e, "w2.scale") for e in ids]), "w2.scale"),
    }
