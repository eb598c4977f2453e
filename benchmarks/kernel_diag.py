"""Where does the GPU fast path leave the reference? Runs the `small` preset three ways on the same
tokens (teacher-forced): the reference decode, the fast path with the torch `*_ref` kernels, the
fast path with the Triton kernels; and checks each Triton call of one step against its ref on the
activations that step really produces.

python benchmarks/kernel_diag.py [--steps 24]
"""

from __future__ import annotations

import argparse

import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.kernels import linear_fp8 as lin
from megastep.kernels import moe
from megastep.model import fast as fast_mod
from megastep.model.fast import FastDecoder
from megastep.model.reference import ReferenceModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = preset("small", layers=args.layers)
    w = synthesize_weights(cfg, seed=0, device=dev, include_mtp=False)
    ref = ReferenceModel(cfg, w, device=dev)
    f_ref = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device=dev, triton=False)
    f_tri = FastDecoder(cfg, w, max_seqs=2, max_ctx=512, device=dev, triton=True)
    f_ref.pools.reset(0), f_tri.pools.reset(0)
    st = ref.new_state()
    ids = torch.randint(0, cfg.vocab_size, (args.steps,), generator=torch.Generator().manual_seed(1)).tolist()
    print("step  |ref - fast(torch refs)|  |ref - fast(triton)|  |fast(torch) - fast(triton)|")
    for t, tok in enumerate(ids):
        a = ref.forward(st, [tok])[0]
        one = lambda d: d.step(torch.tensor([tok], device=dev), torch.tensor([t], device=dev), torch.tensor([0], device=dev))[0]  # noqa: E731
        b, c = one(f_ref), one(f_tri)
        print(f"{t:4d}  {(a - b).abs().max().item():.3e}  {(a - c).abs().max().item():.3e}  {(b - c).abs().max().item():.3e}")

    # each Triton call of one step vs its ref on the same inputs
    worst: dict[str, float] = {}
    orig_lin, orig_moe = lin.linear_fp8, moe.moe_experts_mxfp4

    def lin_check(x, wq, sc, block=128, out_dtype=torch.bfloat16, config=None):
        y = orig_lin(x, wq, sc, block=block, out_dtype=out_dtype)
        r = lin.linear_fp8_ref(x, wq, sc, block=block, out_dtype=out_dtype)
        key = f"linear_fp8 M={x.shape[0]} N={wq.shape[0]} K={wq.shape[1]}"
        worst[key] = max(worst.get(key, 0.0), ((y.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item())
        return y

    def moe_check(x, ids_, wts, *a, **k):
        y = orig_moe(x, ids_, wts, *a, **k)
        r = moe.moe_experts_mxfp4_ref(x, ids_, wts, *a, **k)
        key = f"moe M={x.shape[0]}"
        worst[key] = max(worst.get(key, 0.0), ((y - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
        return y

    fast_mod._lin.linear_fp8, fast_mod._moe.moe_experts_mxfp4 = lin_check, moe_check
    for B in (1, 16):
        f_tri.step(torch.randint(0, 1000, (B,), device=dev), torch.full((B,), 40, device=dev),
                   torch.zeros(B, dtype=torch.long, device=dev))
    print("\nTriton vs ref on real activations (max |diff| / max |ref|):")
    for k, v in sorted(worst.items()):
        print(f"  {k:<40} {v:.3e}")


if __name__ == "__main__":
    main()
