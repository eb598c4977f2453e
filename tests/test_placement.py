"""Expert placement: budget, preference for hot experts, determinism, degenerate budgets, and the
`inspect --hbm-budget` text from headers only."""

import json

import pytest
import torch

from megastep import routing as rt
from megastep.checkpoint.synthetic import preset, write_checkpoint
from megastep.checkpoint.tensors import expected_tensors
from megastep.config import ModelConfig
from megastep.errors import UserError
from megastep.runtime.experts import (
    describe_with_budget, plan_placement, resident_bytes, routed_expert_bytes,
)

TINY = preset("tiny")  # 4 layers x 8 experts, top-2


def skewed_profile(cfg, seed=0, tokens=500):
    """A profile with distinct, reproducible counts per layer (sums = tokens * k)."""
    g = torch.Generator().manual_seed(seed)
    counts = []
    for _ in range(cfg.num_hidden_layers):
        p = torch.softmax(2 * torch.randn(cfg.n_routed_experts, generator=g), 0)
        picks = torch.stack([torch.multinomial(p, cfg.num_experts_per_tok, generator=g) for _ in range(tokens)])
        counts.append(torch.bincount(picks.flatten(), minlength=cfg.n_routed_experts).tolist())
    return rt.make_profile(cfg, counts, tokens, {"kind": "test"})


def test_expert_and_resident_bytes_from_the_table():
    cfg = ModelConfig()
    # V4-Flash: w1, w3 [2048, 4096] and w2 [4096, 2048] in MXFP4 (half a byte) + E8M0 per 32.
    assert routed_expert_bytes(cfg) == 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32) == 13_369_344
    table = expected_tensors(TINY, include_mtp=False)
    experts = sum(s.nbytes for n, s in table.items() if ".ffn.experts." in n)
    assert experts == routed_expert_bytes(TINY) * TINY.num_hidden_layers * TINY.n_routed_experts
    assert resident_bytes(TINY) + experts == sum(s.nbytes for s in table.values())


@pytest.mark.parametrize("profile", [None, "skewed"])
def test_budget_is_respected_exactly(profile):
    prof = skewed_profile(TINY) if profile else None
    eb, fixed = routed_expert_bytes(TINY), resident_bytes(TINY)
    total = TINY.num_hidden_layers * TINY.n_routed_experts
    for budget in [fixed, fixed + 1, fixed + eb - 1, fixed + eb, fixed + 7 * eb + 3, fixed + 31 * eb, fixed + 10**9]:
        p = plan_placement(TINY, prof, budget)
        assert p.hbm_bytes <= budget
        assert p.n_hot == total or budget - p.hbm_bytes < eb
        assert p.hbm_bytes + p.host_bytes == fixed + total * eb
        assert p.n_hot == sum(p.hot_per_layer()) == sum(len(p.hot(L)) for L in range(4))


def test_prefers_hot_experts():
    prof = skewed_profile(TINY)
    eb, fixed = routed_expert_bytes(TINY), resident_bytes(TINY)
    p = plan_placement(TINY, prof, fixed + 12 * eb)
    share = lambda L, e: prof["counts"][L][e] / prof["layer_totals"][L]  # noqa: E731
    hot = [share(L, e) for L in range(4) for e in p.hot(L)]
    cold = [share(L, e) for L in range(4) for e in p.cold(L)]
    assert len(hot) == 12 and min(hot) >= max(cold)
    # Expected cold share = cold slots / all slots, from the profile.
    cold_slots = sum(prof["counts"][L][e] for L in range(4) for e in p.cold(L))
    assert p.cold_fraction == pytest.approx(cold_slots / prof["total_slots"])
    # Batch 1: each cold slot reads one expert.
    assert p.cold_bytes_per_step(1) == pytest.approx(p.cold_fraction * 4 * 2 * eb)
    # A hotter profile leaves less cold work for the same budget than uniform routing.
    assert p.cold_fraction < plan_placement(TINY, None, fixed + 12 * eb).cold_fraction == pytest.approx(20 / 32)


def test_deterministic_and_ties_go_to_each_layers_hottest_first():
    prof = skewed_profile(TINY)
    budget = resident_bytes(TINY) + 13 * routed_expert_bytes(TINY)
    a, b = plan_placement(TINY, prof, budget), plan_placement(TINY, json.loads(json.dumps(prof)), budget)
    assert a.order == b.order and a.n_hot == b.n_hot and torch.equal(a.slot_table(), b.slot_table())
    # Uniform routing: round robin over layers, expert ids ascending, lower layers first.
    u = plan_placement(TINY, None, resident_bytes(TINY) + 10 * routed_expert_bytes(TINY))
    assert u.order[:6] == ((0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1))
    assert u.hot_per_layer() == [3, 3, 2, 2]
    assert u.hot(0) == [0, 1, 2] and u.cold(3) == [2, 3, 4, 5, 6, 7]
    # Equal counts within a profile row: the lower expert id first.
    flat = rt.make_profile(TINY, [[5, 9, 9, 1, 0, 0, 0, 0]] * 4, 12, {"kind": "test"})
    f = plan_placement(TINY, flat, resident_bytes(TINY) + 5 * routed_expert_bytes(TINY))
    assert f.order[:5] == ((0, 1), (1, 1), (2, 1), (3, 1), (0, 2))


def test_slot_table():
    p = plan_placement(TINY, skewed_profile(TINY), resident_bytes(TINY) + 13 * routed_expert_bytes(TINY))
    t = p.slot_table()
    assert t.shape == (4, 8) and t.dtype == torch.int32
    for L in range(4):
        assert [int(t[L, e]) for e in p.hot(L)] == list(range(len(p.hot(L))))
        assert [int(t[L, e]) for e in p.cold(L)] == [-1 - i for i in range(len(p.cold(L)))]


def test_degenerate_budgets():
    eb, fixed = routed_expert_bytes(TINY), resident_bytes(TINY)
    none = plan_placement(TINY, None, fixed)
    assert none.n_hot == 0 and none.cold_fraction == pytest.approx(1.0) and none.hbm_bytes == fixed
    everything = plan_placement(TINY, skewed_profile(TINY), fixed + 32 * eb + 12345)
    assert everything.n_hot == 32 and everything.cold_fraction == 0 and everything.host_bytes == 0
    assert everything.cold_bytes_per_step(6) == 0
    zero = plan_placement(TINY, None, 0, expert_bytes=eb, fixed_bytes=0)
    assert zero.n_hot == 0 and zero.hbm_bytes == 0
    with pytest.raises(UserError, match="below the .* of weights that must stay in HBM"):
        plan_placement(TINY, None, 0)
    with pytest.raises(UserError, match=">= 0"):
        plan_placement(TINY, None, -1, fixed_bytes=0)
    with pytest.raises(UserError, match="num_layers"):
        plan_placement(TINY, rt.uniform_profile(preset("tiny", layers=2)), fixed)


def test_describe_with_budget_from_headers(tmp_path):
    cfg = TINY.replace(vocab_size=512)
    d = write_checkpoint(cfg, tmp_path / "ck", seed=0).path
    fixed, eb = resident_bytes(cfg), routed_expert_bytes(cfg)
    text = describe_with_budget(d, (fixed + 20 * eb) / 1e9)
    assert "uniform routing ASSUMED" in text and "routed experts (20, 62.5%)" in text
    assert "expected cold share of routing slots: 37.5%" in text
    prof = skewed_profile(cfg)
    rt.save_profile(prof, tmp_path / "p.json")
    text = describe_with_budget(d, (fixed + 20 * eb) / 1e9, tmp_path / "p.json")
    assert "from a test routing profile" in text and "ASSUMED" not in text
    with pytest.raises(UserError, match="num_layers"):
        describe_with_budget(d, 1.0, rt.uniform_profile(TINY.replace(num_hidden_layers=3, vocab_size=512)))
    with pytest.raises(UserError, match="hbm-budget"):
        describe_with_budget(d, "lots")
    with pytest.raises(UserError, match="below"):
        describe_with_budget(d, 0)


def test_describe_full_v4_flash_from_config_alone(tmp_path):
    """Headers only: a directory with just config.json plans instantly at full geometry."""
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig().to_dict()))
    text = describe_with_budget(tmp_path, 130)
    assert "43 layers x 256 = 11008, 13.37 MB each" in text
    assert "HBM:  130.00 GB" in text and "ASSUMED" in text


def test_budget_argument():
    """--hbm-budget takes decimal GB >= 0 or "auto"; anything else is one argparse message."""
    import argparse

    from megastep.errors import AUTO, budget_arg

    assert budget_arg("auto") == AUTO and budget_arg("125") == 125.0 and budget_arg("0") == 0.0
    for bad in ("12GB", "-1", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="number of GB"):
            budget_arg(bad)


def test_auto_budget_is_free_memory_less_state_build_and_margin(monkeypatch):
    """`--hbm-budget auto`: the device's free bytes less the state pools (their layout sized without
    allocating), twice a layer's routed experts (a layer's build) and the margin; never below 0."""
    from megastep.model.state_pools import StatePools
    from megastep.runtime import experts as ex

    cfg = preset("small")
    free = 150 * 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 151 * 10**9))
    state = StatePools(cfg, 6, 4224, torch.bfloat16, "cpu", max_block=6).bytes()  # real tensors: the same bytes
    layer = cfg.n_routed_experts * routed_expert_bytes(cfg)
    got = ex.auto_budget_bytes(cfg, torch.device("cuda"), max_seqs=6, max_ctx=4224, max_block=6)
    assert got == free - state - 2 * layer - ex.AUTO_MARGIN_BYTES
    assert state > StatePools(cfg, 1, 4224, torch.bfloat16, "cpu").bytes()  # rows and block are counted
    free = ex.AUTO_MARGIN_BYTES
    assert ex.auto_budget_bytes(cfg, torch.device("cuda"), max_seqs=6, max_ctx=4224) == 0
