"""benchmarks/expert_passes.py: the experts kernels' passes over the experts M rows read, modeled on the
synthetic gates without a GPU."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import expert_passes as XP  # noqa: E402
from megastep.checkpoint.synthetic import preset, synthesize_tensors  # noqa: E402
from megastep.routing import gate_prefix, random_routes  # noqa: E402


def test_random_routes_are_top_k_distinct_experts_of_both_kinds_of_layer():
    """routing.random_routes, the script's rows (and the bench's profile's)."""
    cfg = preset("small")
    names = []
    for L in range(cfg.num_hidden_layers):
        p = gate_prefix(L)
        names += [p + ".tid2eid"] if cfg.is_hash_layer(L) else [p + ".weight", p + ".bias"]
    gates = dict(synthesize_tensors(cfg, 0, include_mtp=False, names=names))
    kinds = set()
    for L in range(cfg.num_hidden_layers):
        idx = random_routes(cfg, gates, L, 5, 1, tag="rows")
        assert idx.shape == (5, cfg.num_experts_per_tok)
        assert all(len(set(r)) == cfg.num_experts_per_tok for r in idx.tolist())  # a row's experts differ
        assert int(idx.min()) >= 0 and int(idx.max()) < cfg.n_routed_experts
        assert torch.equal(idx, random_routes(cfg, gates, L, 5, 1, tag="rows"))  # reproducible
        kinds.add(cfg.is_hash_layer(L))
    assert kinds == {True, False}  # both kinds of layer were exercised


def test_main_prints_a_line_per_routing_and_row_count(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["expert_passes.py", "--rows", "1,3", "--routing", "default", "--layers", "2",
                                      "--draws", "1"])
    XP.main()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " rows: " in ln]
    assert len(lines) == 2
    assert lines[0].startswith("default    1 rows:    6.0 experts,    6.0 passes; per expert 1.000, 1.000, 1.000; most 1")
