"""The reference decode on its own terms: state semantics, determinism, the quantization
simulations (MODEL_SPEC §3, §9.1 tier 3-4), and bad input."""

import pytest
import torch

from megastep.checkpoint import formats
from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.errors import UserError
from megastep.model.ops import KV_SIM_BLOCK
from megastep.model.reference import ReferenceModel


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny").replace(vocab_size=1024)  # the real vocab only slows the head down here
    return cfg, synthesize_weights(cfg, seed=1, include_mtp=False)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks", [[37], [1] * 37, [5, 1, 13, 18], [16, 16, 5]])
def test_chunked_prefill_plus_decode_equals_one_pass(tiny, chunks):
    """Prefill of P tokens in any chunking, then N decode steps, equals one pass over P+N."""
    cfg, w = tiny
    m = ReferenceModel(cfg, w)
    ids = _ids(45)
    full = m.forward(m.new_state(), ids)
    st = m.new_state()
    parts, at = [], 0
    for c in chunks:
        parts.append(m.forward(st, ids[at : at + c]))
        at += c
    for t in ids[at:].tolist():
        parts.append(m.forward(st, [t]))
    assert torch.equal(torch.cat(parts), full)
    assert st.pos == 45


def test_same_input_same_bits(tiny):
    cfg, w = tiny
    a = ReferenceModel(cfg, w).forward(ReferenceModel(cfg, w).new_state(), _ids(30, 3))
    w2 = synthesize_weights(cfg, seed=1, include_mtp=False)  # rebuilt from the seed
    b = ReferenceModel(cfg, w2).forward(ReferenceModel(cfg, w2).new_state(), _ids(30, 3))
    assert torch.equal(a, b)


def test_logits_are_healthy(tiny):
    cfg, w = tiny
    m = ReferenceModel(cfg, w)
    lg = m.forward(m.new_state(), _ids(60, 4))
    assert torch.isfinite(lg).all()
    assert lg.std(-1).min() > 0.1  # not flat
    assert len(set(lg.argmax(-1).tolist())) > 10  # not one token everywhere


def test_simulations_are_applied_and_switchable(tiny):
    cfg, w = tiny
    on, off = ReferenceModel(cfg, w, quant_sim=True), ReferenceModel(cfg, w, quant_sim=False)
    ids = _ids(40, 5)
    s_on, s_off = on.new_state(), off.new_state()
    a, b = on.forward(s_on, ids), off.forward(s_off, ids)
    assert not torch.equal(a, b)
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9  # same model, small noise

    nope = cfg.nope_head_dim
    for L, ls in enumerate(s_on.layers):
        win = ls.window
        # window KV: nope dims sit on the fp8 grid of their 64-channel blocks (re-quantizing is a
        # no-op); without the simulation they do not
        assert torch.equal(formats.fp8_act_sim(win[:, :nope], KV_SIM_BLOCK), win[:, :nope])
        assert not torch.equal(formats.fp8_act_sim(s_off.layers[L].window[:, :nope], KV_SIM_BLOCK),
                               s_off.layers[L].window[:, :nope])
        if ls.indexer is not None:
            keys = ls.indexer.entries.rows
            assert keys.shape[0] == 40 // 4
            assert torch.equal(formats.fp4_act_sim(keys, 32), keys)  # index keys are FP4 (after Hadamard)
        if ls.compressor is not None:
            e = ls.compressor.entries.rows
            assert e.shape[0] == 40 // cfg.ratio(L)
            assert torch.equal(formats.fp8_act_sim(e[:, :nope], KV_SIM_BLOCK), e[:, :nope])


def test_state_shapes_follow_the_layer_kinds(tiny):
    cfg, w = tiny
    m = ReferenceModel(cfg, w)
    st = m.new_state()
    m.forward(st, _ids(33, 6))
    for L, ls in enumerate(st.layers):
        kind = cfg.layer_kind(L)
        assert ls.window.shape == (cfg.sliding_window, cfg.head_dim)
        assert (ls.compressor is None) == (kind == "sliding")
        assert (ls.indexer is None) == (kind != "csa")
        if kind == "csa":  # overlapping: 8 rows of [Ca | Cb]
            assert ls.compressor.kv.shape == (8, 2 * cfg.head_dim)
            assert ls.indexer.kv.shape == (8, 2 * cfg.index_head_dim)
        elif kind == "hca":
            assert ls.compressor.kv.shape == (cfg.ratio(L), cfg.head_dim)


def test_bad_input_is_a_user_error(tiny):
    cfg, w = tiny
    m = ReferenceModel(cfg, w)
    with pytest.raises(UserError, match="empty"):
        m.forward(m.new_state(), [])
    with pytest.raises(UserError, match="outside the vocabulary"):
        m.forward(m.new_state(), [cfg.vocab_size])
    st = m.new_state()
    st.pos = cfg.max_position_embeddings
    with pytest.raises(UserError, match="exceeds the model's limit"):
        m.forward(st, [1])
