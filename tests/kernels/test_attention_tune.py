"""attention.pick_config's pinned table and benchmarks/kernels/tune_attention.py (its candidates,
install(), and one checked-and-timed candidate plus one that raises, on tiny shapes)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "kernels"))
import tune_attention as T  # noqa: E402

A = T.A  # megastep.kernels.attention, as the script holds it
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_pinned_first_then_rule(monkeypatch):
    monkeypatch.setattr(A, "_PINNED", {})
    rule = A.pick_config(64, 640, 512)
    assert rule == A.AttnConfig(32, 32, 128, pv_pieces=2, num_warps=8, num_stages=2)
    pinned = A.AttnConfig(16, 64, 64, pv_pieces=2, num_warps=4, num_stages=2)
    T.install({(64, 640, 512): pinned})
    assert A.pick_config(64, 640, 512) == pinned
    assert A.pick_config(64, 641, 512) == A.AttnConfig(32, 32, 128) != pinned  # other keys: the rule
    assert T.rule_config(64, 640, 512) == rule and A.pick_config(64, 640, 512) == pinned


@pytest.mark.parametrize("kind", T.model_kinds((4096, 32768)), ids=lambda k: k.name)
def test_candidates(kind):
    p1 = T.phase1(kind)
    assert T.rule_config(*kind.key) in p1 and len(set(p1)) == len(p1) <= T.MAX_CANDS
    p2 = T.phase2(p1, p1[1:4])
    assert not set(p1) & set(p2) and len(set(p2)) == len(p2) and len(p1) + len(p2) <= T.MAX_CANDS
    for c in p1 + p2:
        c.check()
        assert T.allowed(c) and c.pv_pieces == 2


def test_v4_kinds():
    got = {k.name: k.key for k in T.model_kinds((4096,))}
    assert got == {"swa": (64, 128, 512), "csa": (64, 640, 512), "hca@4096": (64, 161, 512)}


def test_measure_ok_and_raising(monkeypatch):
    monkeypatch.setattr(T.BK, "DEV", DEV)  # graph_time: eager calls on the CPU
    kind = T.model_kinds(smoke=True)[1]  # csa: H 20, N 40, d 32
    inp = T.Inputs(kind, DEV, bmax=3, copies=2, n1=2, nb=2)
    a, kw = inp.calls[3][0]
    ref = A.sparse_attention_pools_ref(*a, **kw)
    rule = T.rule_config(*kind.key)
    good = T.measure(inp, A.AttnConfig(16, 16, 16), ref, 3, rule, 1)
    assert good["ok"] and good["t1"] > 0 and good["t64"] > 0, good
    bad = T.measure(inp, A.AttnConfig(16, 32, 16), ref, 3, rule, 1)  # chunk < block_n: check() raises
    assert not bad["ok"] and bad["msg"].startswith("raised") and bad["t1"] is None
    rows = [good, bad]
    T.objective(rows)
    assert good["score"] == good["t1"] / T.STEP_US[1] + good["t64"] / T.STEP_US[64] and "score" not in bad
    assert T.ranked(rows) == [good["cfg"]]
