"""The programmatic-dependent-launch switch (common.set_pdl / launch_opts / pdl_enter).

PDL only changes when a kernel's CTAs may start, never what they compute: with the switch on,
kernels must give the same bits as with it off. Under the interpreter the gdc_* instructions
raise, so launch_opts must keep PDL off for CPU tensors whatever the switch says."""

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

from megastep.kernels.common import launch_opts, pdl_enabled, set_pdl
from megastep.kernels.dense import linear_bf16
from megastep.kernels.rope_norm import q_norm_rope, rms_norm
from megastep.kernels.router import route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODULES = ["attention", "compressor", "dense", "expert_table", "indexer", "linear_fp8", "mhc", "moe",
                  "moe_route", "pair_combine", "rope_norm", "router"]


@pytest.fixture
def pdl_restore():
    old = pdl_enabled()
    try:
        yield
    finally:
        set_pdl(old)


def test_default_off():
    assert pdl_enabled() is False
    assert launch_opts(torch.zeros(1), (1,)) == {"PDL": 0, "launch_pdl": False}


def test_set_pdl_toggles_and_returns_old(pdl_restore):
    assert set_pdl(True) is False
    assert pdl_enabled() is True
    assert set_pdl(False) is True
    assert pdl_enabled() is False


def test_launch_opts_off_on_interpreter(pdl_restore):
    set_pdl(True)
    assert launch_opts(torch.zeros(2, 3), (1,)) == {"PDL": 0, "launch_pdl": False}
    if torch.cuda.is_available():
        assert launch_opts(torch.zeros(1, device="cuda"), (1,)) == {"PDL": 2, "launch_pdl": True}
    set_pdl(False)
    if torch.cuda.is_available():
        assert launch_opts(torch.zeros(1, device="cuda"), (1,)) == {"PDL": 0, "launch_pdl": False}


def _launched_kernels():
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"megastep.kernels.{name}")
        for attr, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if attr.endswith("_kernel") and callable(fn) and fn.__module__ == mod.__name__:
                yield f"{name}.{attr}", fn


# loads allowed before pdl_enter: weights, which never depend on the predecessor kernel
_WEIGHT_LOADS_BEFORE_WAIT = {"mhc._hc_mix_partial_kernel": {"fn_ptr"}}
_MEMORY_CALLS = ("tl.load", "tl.store", "tl.atomic", "_load", "_store")


def _calls(node):
    return [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]


def test_every_kernel_enters_through_pdl_enter():
    """gdc_wait must come before any global memory access the predecessor may affect:
    `pdl_enter(PDL)` is a top-level statement, and before it only index arithmetic, the L2
    prefetch of weight rows (`if PREFETCH_LINES:` blocks) and loads of listed weight pointers."""
    seen = []
    for name, fn in _launched_kernels():
        seen.append(name)
        assert "PDL" in inspect.signature(fn).parameters, name
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
        src = [ast.unparse(st) for st in body]
        assert "pdl_enter(PDL)" in src, name
        allowed = _WEIGHT_LOADS_BEFORE_WAIT.get(name, set())
        for st in body[:src.index("pdl_enter(PDL)")]:
            if isinstance(st, ast.If) and ast.unparse(st.test) == "PREFETCH_LINES":
                assert set(_calls(st)) <= {"l2_prefetch_rows", "tl.minimum"}, (name, ast.unparse(st))
                continue
            for c in ast.walk(st):
                if isinstance(c, ast.Call) and ast.unparse(c.func).startswith(_MEMORY_CALLS):
                    ptrs = {n.id for n in ast.walk(c.args[0]) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
                    assert ast.unparse(c.func) == "tl.load" and ptrs and ptrs <= allowed, (name, ast.unparse(st))
        # the release point (PDL_LATE) comes after the wait
        rel = [i for i, t in enumerate(src) if "pdl_release(PDL)" in t]
        assert all(i > src.index("pdl_enter(PDL)") for i in rel), name
    assert len(seen) >= 18, seen  # the kernels at the time of writing: none skipped by the lookup


def test_launch_mode_follows_the_grid(pdl_restore, monkeypatch):
    """One wave or less releases the next kernel at entry (PDL_EARLY); a larger grid releases it
    late, so the waiting CTAs do not take slots this grid still needs; off: no PDL at all."""
    from megastep.kernels import common

    monkeypatch.setattr(common, "on_interpreter", lambda t: False)
    monkeypatch.setitem(common._SMS, 0, 132)
    t = torch.zeros(1)
    t_dev = type("T", (), {"device": torch.device("cuda", 0)})()
    set_pdl(False)
    assert common.launch_opts(t_dev, (1,)) == {"PDL": common.PDL_OFF, "launch_pdl": False}
    set_pdl(True)
    assert common.launch_opts(t_dev, (132,)) == {"PDL": common.PDL_EARLY, "launch_pdl": True}
    assert common.launch_opts(t_dev, (4, 10, 4)) == {"PDL": common.PDL_LATE, "launch_pdl": True}
    assert common.prefetch_lines(common.launch_opts(t_dev, (4,)), 4096) == common.PREFETCH_BYTES // 128
    assert common.prefetch_lines(common.launch_opts(t_dev, (4,)), 200) == 2  # the row's 200 bytes: 2 lines
    set_pdl(False)
    assert common.prefetch_lines(common.launch_opts(t, (4,)), 4096) == 0


def test_large_weight_streams_placed_plainly(pdl_restore, monkeypatch):
    """Above PLAIN_PLACEMENT_BYTES a launch goes without the PDL attribute (placed once its
    predecessor completed) and still releases its dependents (PDL_PLAIN); at or below it, and
    with the limit None, nothing changes; with PDL off, nothing at all. No prefetch when plain."""
    from megastep.kernels import common

    monkeypatch.setattr(common, "on_interpreter", lambda t: False)
    monkeypatch.setitem(common._SMS, 0, 132)
    t_dev = type("T", (), {"device": torch.device("cuda", 0)})()
    set_pdl(True)
    monkeypatch.setattr(common, "PLAIN_PLACEMENT_BYTES", None)
    assert common.launch_opts(t_dev, (4, 10, 4), 1 << 30) == {"PDL": common.PDL_LATE, "launch_pdl": True}
    monkeypatch.setattr(common, "PLAIN_PLACEMENT_BYTES", 16 << 20)
    assert common.launch_opts(t_dev, (4, 10, 4), 16 << 20) == {"PDL": common.PDL_LATE, "launch_pdl": True}
    assert common.launch_opts(t_dev, (132,), 16 << 20) == {"PDL": common.PDL_EARLY, "launch_pdl": True}
    plain = common.launch_opts(t_dev, (4, 10, 4), (16 << 20) + 1)
    assert plain == {"PDL": common.PDL_PLAIN, "launch_pdl": False}
    assert common.launch_opts(t_dev, (1,), 1 << 30) == plain  # whatever the grid
    assert common.prefetch_lines(plain, 4096) == 0
    set_pdl(False)
    assert common.launch_opts(t_dev, (4, 10, 4), 1 << 30) == {"PDL": common.PDL_OFF, "launch_pdl": False}


def _run_kernels():
    g = torch.Generator(device="cpu").manual_seed(7)
    x = (torch.randn(3, 96, generator=g) * 3).bfloat16().to(DEV)
    w = (torch.rand(96, generator=g) + 0.5).to(DEV)
    wl = (torch.randn(40, 96, generator=g) * 0.05).bfloat16().to(DEV)
    q = torch.randn(3, 4, 64, generator=g).bfloat16().to(DEV)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))).to(DEV)
    pos = torch.tensor([0, 5, 1000], dtype=torch.int64, device=DEV)
    logits = torch.randn(3, 32, generator=g).to(DEV)
    bias = (torch.randn(32, generator=g) * 0.1).to(DEV)
    idx, rw = route(logits, bias, None, 6, 1.5)
    return [rms_norm(x, w, 1e-6), linear_bf16(x, wl), q_norm_rope(q, inv_freq, pos, 1e-6), idx, rw]


def test_results_bit_identical_with_pdl(pdl_restore):
    set_pdl(False)
    off = _run_kernels()
    set_pdl(True)
    on = _run_kernels()
    for a, b in zip(off, on):
        assert a.dtype == b.dtype and torch.equal(a, b)

