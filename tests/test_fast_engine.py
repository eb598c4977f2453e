"""FastEngine (the fast step behind the scheduler's Engine protocol) on CPU, with the torch refs:
slots are taken and given back, rows of different lengths share steps, and a one-token prompt
gives the reference's logits."""

import pytest
import torch

from megastep.checkpoint.synthetic import preset, write_checkpoint
from megastep.config import QuantConfig
from megastep.runtime.engine import FastEngine, ReferenceEngine


def test_fast_engine_rows_slots_and_first_logits(tmp_path):
    cfg = preset("tiny").replace(vocab_size=512, quantization_config=QuantConfig(weight_block_size=(128, 128)))
    write_checkpoint(cfg, tmp_path, seed=4)
    fast = FastEngine(tmp_path, device="cpu", max_seqs=2, max_ctx=64)
    ref = ReferenceEngine(tmp_path)
    a, b = fast.new_sequence(), fast.new_sequence()
    ra = ref.new_sequence()
    # a one-token prompt and a 5-token prefill chunk in the same call
    out = fast.forward_batch([(a, [7]), (b, [1, 2, 3, 4, 5])])
    want = ref.forward_batch([(ra, [7])])[0]
    assert torch.allclose(out[0], want, atol=1e-5 * want.abs().max().item())
    assert out[1].shape == (cfg.vocab_size,) and torch.isfinite(out[1]).all()
    assert (a.pos, b.pos) == (1, 5)
    slot_a = a.data
    fast.free(a)
    c = fast.new_sequence()  # a's slot comes back, reset
    assert c.data == slot_a
    out_c = fast.forward_batch([(c, [7])])[0]
    assert torch.allclose(out_c, out[0], atol=1e-5 * want.abs().max().item())
    fast.free(b), fast.free(c)
    assert fast.live_sequences == 0


def test_prefill_in_blocks_equals_token_by_token(tmp_path):
    """Prefill chunks go through the step as multi-token blocks (up to max_block tokens of a
    sequence per replay): the last token's logits equal those of feeding the prompt one token per
    step and the reference's, with another sequence decoding in the same steps."""
    cfg = preset("tiny").replace(vocab_size=512, quantization_config=QuantConfig(weight_block_size=(128, 128)))
    write_checkpoint(cfg, tmp_path, seed=5)
    prompt = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = ReferenceEngine(tmp_path)
    want = ref.forward_batch([(ref.new_sequence(), prompt)])[0]
    outs = {}
    for block in (1, 4):
        fast = FastEngine(tmp_path, device="cpu", max_seqs=2, max_ctx=64, max_block=block)
        a, other = fast.new_sequence(), fast.new_sequence()
        fast.forward_batch([(other, [3, 4])])
        outs[block] = fast.forward_batch([(a, prompt), (other, [5])])[0]
        assert a.pos == len(prompt) and other.pos == 3
    scale = want.abs().max().item()
    assert torch.allclose(outs[4], outs[1], atol=1e-5 * scale), (outs[4] - outs[1]).abs().max()
    assert torch.allclose(outs[4], want, atol=1e-5 * scale), (outs[4] - want).abs().max()


def test_hbm_budget_loads_lazily_with_a_placement(tmp_path):
    """--hbm-budget: the checkpoint is read tensor by tensor while the layers are built, the
    placement covers every expert, and the engine gives the same logits as a plain load (on the
    CPU the torch twins run, so the cold experts take the same path)."""
    from megastep.errors import UserError
    from megastep.runtime.experts import GB, resident_bytes, routed_expert_bytes

    cfg = preset("tiny").replace(vocab_size=512, quantization_config=QuantConfig(weight_block_size=(128, 128)))
    write_checkpoint(cfg, tmp_path, seed=6)
    budget = (resident_bytes(cfg) + 10 * routed_expert_bytes(cfg)) / GB
    plain = FastEngine(tmp_path, device="cpu", max_seqs=1, max_ctx=32)
    placed = FastEngine(tmp_path, device="cpu", max_seqs=1, max_ctx=32, hbm_budget_gb=budget)
    assert placed.placement.n_hot == 10 and placed.placement.n_cold == cfg.num_hidden_layers * cfg.n_routed_experts - 10
    outs = [e.forward_batch([(e.new_sequence(), [3, 1, 4, 1, 5])])[0] for e in (plain, placed)]
    assert torch.equal(*outs)
    with pytest.raises(UserError, match="Triton"):
        FastEngine(tmp_path, device="cpu", max_seqs=1, max_ctx=32, hbm_budget_gb=budget, cold_path="cpu")
    with pytest.raises(UserError, match="hbm-budget"):
        FastEngine(tmp_path, device="cpu", max_seqs=1, max_ctx=32, routing_profile=tmp_path / "p.json")
    with pytest.raises(UserError, match="auto sizes the budget from a CUDA device"):
        FastEngine(tmp_path, device="cpu", max_seqs=1, max_ctx=32, hbm_budget_gb="auto")
