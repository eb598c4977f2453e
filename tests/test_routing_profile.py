"""Routing profiles (collection through the reference decode, JSON, validation) and the routing
models of synthetic checkpoints (default, uniform, skewed)."""

import json

import pytest
import torch

from megastep import routing as rt
from megastep.checkpoint.synthetic import preset, synthesize_tensors, synthesize_weights, write_checkpoint
from megastep.errors import UserError
from megastep.model.reference import ReferenceModel

# Hash layer 0, score layers 1-2 (CSA, HCA), 8 experts top-2; a small vocab keeps the head cheap.
MICRO = preset("tiny", layers=3).replace(vocab_size=512, num_nextn_predict_layers=0)
PROMPTS = [[3, 17, 42, 5, 99], [100, 7, 7], [511]]


@pytest.fixture(scope="module")
def micro_weights():
    return synthesize_weights(MICRO, seed=0)


@pytest.fixture(scope="module")
def micro_profile(micro_weights):
    return rt.collect_routing_profile((MICRO, micro_weights), PROMPTS, max_new_tokens=3)


def direct_counts(weights, prompts, max_new_tokens):
    """Per-layer expert counts recorded straight from ReferenceModel.route, and the tokens fed."""
    model = ReferenceModel(MICRO, weights)
    counts = torch.zeros(MICRO.num_hidden_layers, MICRO.n_routed_experts, dtype=torch.int64)
    route = model.route

    def recording_route(x, L, token):
        idx, w = route(x, L, token)
        counts[L] += torch.bincount(idx, minlength=MICRO.n_routed_experts)
        return idx, w

    model.route = recording_route
    fed = []
    for ids in prompts:
        st = model.new_state()
        logits = model.forward(st, ids)[-1]
        fed += ids
        for _ in range(max_new_tokens):
            t = int(logits.argmax())
            logits = model.forward(st, [t])[-1]
            fed.append(t)
    return counts, fed


def test_profile_counts_match_the_reference_route(micro_weights, micro_profile):
    p = micro_profile
    k = MICRO.num_experts_per_tok
    tokens = sum(len(q) for q in PROMPTS) + 3 * len(PROMPTS)
    assert p["tokens"] == tokens
    assert (p["num_layers"], p["n_routed_experts"], p["top_k"], p["hash_layers"]) == (3, 8, 2, [0])
    assert p["layer_totals"] == [tokens * k] * 3 and p["total_slots"] == 3 * tokens * k
    assert all(sum(r) == tokens * k for r in p["counts"])
    counts, fed = direct_counts(micro_weights, PROMPTS, 3)
    assert p["counts"] == counts.tolist()
    # The hash layer routes by tid2eid of each token fed.
    t2e = micro_weights["layers.0.ffn.gate.tid2eid"]
    assert p["counts"][0] == torch.bincount(t2e[fed].flatten(), minlength=8).tolist()
    assert p["config_hash"] == rt.config_hash(MICRO) and p["source"]["kind"] == "reference-decode"
    assert "hash layer 0" in rt.profile_summary(p)


def test_profile_from_a_model_directory(tmp_path, micro_profile):
    write_checkpoint(MICRO, tmp_path / "m", seed=0, include_mtp=False)
    p = rt.collect_routing_profile(tmp_path / "m", PROMPTS, max_new_tokens=3)
    assert p["counts"] == micro_profile["counts"] and p["source"]["model_dir"] == str(tmp_path / "m")


def test_json_round_trip(tmp_path, micro_profile):
    path = tmp_path / "profile.json"
    rt.save_profile(micro_profile, path)
    assert json.loads(path.read_text()) == micro_profile
    assert rt.load_profile(path, MICRO) == micro_profile
    assert rt.validate_profile(micro_profile, MICRO) == []


def bad(profile, **change):
    p = json.loads(json.dumps(profile))
    for k, v in change.items():
        if v is None:
            del p[k]
        else:
            p[k] = v
    return p


@pytest.mark.parametrize("change, message", [
    ({"num_layers": 4}, "num_layers is 4 but the model has 3"),
    ({"n_routed_experts": 16}, "n_routed_experts is 16 but the model has 8"),
    ({"top_k": 6}, "top_k is 6 but the model has 2"),
    ({"counts": [[1] * 8] * 2}, "counts has 2 layers, the model has 3"),
    ({"counts": [[1] * 8, [1] * 7, [1] * 8]}, "layer 1 do not hold 8 experts"),
    ({"counts": [[1] * 8, [-1] + [1] * 7, [1] * 8]}, "negative or non-numeric"),
    ({"counts": [[0] * 8, [1] * 8, [1] * 8], "tokens": None}, "layer 0 has no routing counts"),
    ({"counts": [[1] * 8] * 3}, "do not sum to tokens x top_k"),
    ({"counts": None}, "no 'counts'"),
    ({"version": 9}, "version 9"),
])
def test_bad_profile_rejected(micro_profile, change, message):
    with pytest.raises(UserError, match="routing profile does not fit") as e:
        rt.validate_profile(bad(micro_profile, **change), MICRO)
    assert message in str(e.value)


def test_other_config_is_a_note_unless_strict(micro_profile, tmp_path):
    other = MICRO.replace(rope_theta=5000.0)  # same routing geometry, another config.json
    assert rt.validate_profile(micro_profile, other) == ["the profile was collected on another config.json (same routing geometry)"]
    with pytest.raises(UserError, match="another config.json"):
        rt.validate_profile(micro_profile, other, strict_config=True)
    # A supplied profile needs only the geometry and the counts.
    minimal = {"num_layers": 3, "n_routed_experts": 8, "top_k": 2, "counts": [[1.5] * 8] * 3}
    assert rt.validate_profile(minimal, MICRO) == []
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        rt.load_profile(tmp_path / "x.json", MICRO)
    with pytest.raises(UserError, match="no routing profile at"):
        rt.load_profile(tmp_path / "missing.json", MICRO)


def test_bad_prompts(micro_weights):
    src = (MICRO, micro_weights)
    with pytest.raises(UserError, match="no prompts"):
        rt.collect_routing_profile(src, [])
    with pytest.raises(UserError, match="prompt 1 is empty"):
        rt.collect_routing_profile(src, [[1], []])
    with pytest.raises(UserError, match="outside the vocabulary"):
        rt.collect_routing_profile(src, [[1, 512]])


def test_profile_from_random_activations(micro_weights):
    p = rt.profile_from_random_activations(MICRO, micro_weights, tokens=1000)
    assert p["tokens"] == 1000 and all(sum(r) == 2000 for r in p["counts"])
    rt.validate_profile(p, MICRO)


# ---- routing models of synthetic checkpoints ------------------------------------------------------
def gate_tensors(cfg, routing, seed=0):
    names = []
    for L in range(cfg.num_hidden_layers):
        names += [f"layers.{L}.ffn.gate.weight", f"layers.{L}.ffn.gate." + ("tid2eid" if cfg.is_hash_layer(L) else "bias")]
    return dict(synthesize_tensors(cfg, seed, names=names, routing=routing))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_skewed_routing_coverage(name):
    """Top 25% of experts take 60-75% of the slots on a held-out sample, on every layer."""
    cfg = preset(name)
    w = gate_tensors(cfg, "skewed")
    cov = [rt.gate_coverage(cfg, w, L, seed=777) for L in range(cfg.num_hidden_layers)]
    assert all(0.60 <= c <= 0.75 for c in cov), cov
    assert all(abs(c - rt.SKEW_TARGET) < 0.03 for c in cov), cov


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_uniform_routing_coverage(name):
    cfg = preset(name)
    w = gate_tensors(cfg, "uniform")
    cov = [rt.gate_coverage(cfg, w, L, seed=777) for L in range(cfg.num_hidden_layers)]
    assert all(0.22 <= c <= 0.30 for c in cov), cov  # 0.25 exactly uniform
    assert all((w[f"layers.{L}.ffn.gate.bias"] == 0).all() for L in range(cfg.num_hash_layers, cfg.num_hidden_layers))


def test_default_routing_is_unchanged_and_skew_touches_only_gates(micro_weights):
    assert micro_weights.keys() == synthesize_weights(MICRO, 0, routing="default").keys()
    skewed = synthesize_weights(MICRO, 0, routing="skewed")
    raw = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731 (float8: no torch.equal)
    changed = {n for n, t in micro_weights.items() if not torch.equal(raw(t), raw(skewed[n]))}
    assert changed == {"layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "layers.2.ffn.gate.bias"}
    for n in changed:
        assert (skewed[n].dtype, skewed[n].shape) == (micro_weights[n].dtype, micro_weights[n].shape)
    t2e = skewed["layers.0.ffn.gate.tid2eid"]
    assert (t2e[:, 0] != t2e[:, 1]).all() and (t2e >= 0).all() and (t2e < 8).all()
    # The post-pass over in-memory weights and the single functions give the same tensors.
    post = dict(micro_weights)
    fits = rt.apply_skew(post, MICRO, seed=0)
    assert set(fits) == {"layers.0.ffn.gate", "layers.1.ffn.gate", "layers.2.ffn.gate"}
    assert all(torch.equal(post[n], skewed[n]) for n in changed)
    assert torch.equal(rt.skewed_gate_bias(MICRO, micro_weights, 1, seed=0), skewed["layers.1.ffn.gate.bias"])
    assert torch.equal(rt.skewed_tid2eid(MICRO, 0, seed=0)[:512], rt.fit_tid2eid(MICRO, "layers.0.ffn.gate", vocab=512)[0])
    with pytest.raises(ValueError, match="routing"):
        synthesize_weights(MICRO, 0, routing="zipf")


def test_skew_shows_in_the_reference_decode(micro_weights):
    """Through the real decode (activations are not isotropic), skewed routing still concentrates
    on few experts; uniform routing does not."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (24,), generator=g).tolist() for _ in range(4)]
    cov = {}
    for model in ("uniform", "skewed"):
        w = dict(micro_weights)
        rt.apply_routing(w, MICRO, model, seed=0)
        p = rt.collect_routing_profile((MICRO, w), prompts, max_new_tokens=8)
        cov[model] = [rt.top_coverage(r) for r in p["counts"]]
    assert max(cov["uniform"]) < 0.4 and min(cov["skewed"]) > 0.55, cov
