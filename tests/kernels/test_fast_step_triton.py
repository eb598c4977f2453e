"""The batched decode step with its Triton kernels (interpreter on CPU, real on GPU) against the
same step with the torch `*_ref` kernels: every kernel call of a layer of each kind, with the
arguments the step really passes. The first step of fresh sequences takes identical inputs in
both, so it must agree to fp32 rounding; later steps inherit rounding differences through the
quantization simulations (see tests/test_fast_decoder.py), so they only have to stay close."""

import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.config import QuantConfig
from megastep.model.fast import FastDecoder


def test_triton_step_matches_torch_step():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # o_lora_rank 128: wo_a takes the grouped one-launch FP8 path (group rows a multiple of 128)
    cfg = preset("tiny").replace(vocab_size=512, o_lora_rank=128,
                                 quantization_config=QuantConfig(weight_block_size=(128, 128)))
    w = synthesize_weights(cfg, seed=2, device=dev, include_mtp=False)
    tri = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device=dev, triton=True)
    ref = FastDecoder(cfg, w, max_seqs=3, max_ctx=64, device=dev, triton=False)
    for d in (tri, ref):
        d.pools.reset(0), d.pools.reset(1)
    ids = torch.randint(0, 512, (3, 3), generator=torch.Generator().manual_seed(0)).to(dev)
    slots = torch.tensor([0, 1, tri.pools.dummy_slot], device=dev)
    for t in range(3):
        pos = torch.tensor([t, t, 0], device=dev)
        a, b = tri.step(ids[t], pos, slots)[:2], ref.step(ids[t], pos, slots)[:2]
        assert torch.isfinite(a).all()
        if t == 0:
            assert torch.allclose(a, b, atol=1e-5 * b.abs().max().item())
        else:
            assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9
