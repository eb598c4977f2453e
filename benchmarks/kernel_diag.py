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

    # each Triton call of one step vs its ref on the same inputs (in-place outputs included)
    from megastep.kernels import attention, compressor, dense, mhc, rope_norm, router

    worst: dict[str, float] = {}

    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() if a.numel() else 0.0

    def wrap(mod, name):
        kern, ref_fn = getattr(mod, name), getattr(mod, name + "_ref")

        def checked(*args, **kw):
            clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            r_args, r_kw = [clone(a) for a in args], {k: clone(v) for k, v in kw.items()}
            out = kern(*args, **kw)
            ref_out = ref_fn(*r_args, **r_kw)
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
            key = f"{name} {tuple(args[0].shape)}"
            d = max([rel(o, r) for o, r in zip(outs, refs) if isinstance(o, torch.Tensor)] or [0.0])
            for a, ra in zip(args, r_args):  # in-place effects (window ring, pools, entries)
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    d = max(d, rel(a, ra))
            worst[key] = max(worst.get(key, 0.0), d)
            return out

        setattr(mod, name, checked)

    for mod, name in [(lin, "linear_fp8"), (moe, "moe_experts_mxfp4"), (mhc, "mhc_pre"), (mhc, "mhc_post"),
                      (mhc, "mhc_head"), (dense, "linear_bf16"), (attention, "sparse_attention_decode"),
                      (rope_norm, "rms_norm"), (rope_norm, "q_norm_rope"), (rope_norm, "kv_rope_sim_store"),
                      (rope_norm, "indexer_q"), (compressor, "compressor_step"), (router, "route")]:
        wrap(mod, name)
    for B, p in ((1, 40), (2, 43)):  # distinct slots: duplicate scatters would race
        f_tri.step(torch.randint(0, 1000, (B,), device=dev), torch.full((B,), p, device=dev),
                   torch.arange(B, device=dev))
    print("\nTriton vs ref on real activations (max |diff| / max |ref|, outputs and in-place writes):")
    for k, v in sorted(worst.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<48} {v:.3e}")


if __name__ == "__main__":
    main()
