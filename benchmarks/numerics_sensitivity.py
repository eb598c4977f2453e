"""How sensitive is the decode to summation order? Two runs of the reference decode that differ
only in how each linear accumulates its dot products (fp32, or fp64 rounded once to fp32: both
valid implementations of "fp32 accumulation") decode greedily from the same prompt; prints the
per-step max |logit diff| and the first step whose greedy token differs.

python benchmarks/numerics_sensitivity.py [--preset small] [--steps 128] [--no-quant-sim]
"""

import argparse

import torch

from megastep.checkpoint import formats
from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.model.reference import ReferenceModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--no-quant-sim", action="store_true")
    args = ap.parse_args()
    cfg = preset(args.preset)
    w = synthesize_weights(cfg, 0, include_mtp=False)
    a = ReferenceModel(cfg, w, quant_sim=not args.no_quant_sim)
    b = ReferenceModel(cfg, w, quant_sim=not args.no_quant_sim)

    def linear_fp64(x, name, out_fp32=False):
        if b.quant_sim and name in b.quantized:
            x = formats.fp8_act_sim(x, b.act_block)
        y = (x.double() @ b.w[name].double().T).float()
        return y if out_fp32 else y.to(x.dtype)

    b.linear = linear_fp64
    prompt = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    sa, sb = a.new_state(), b.new_state()
    la, lb = a.forward(sa, prompt)[-1], b.forward(sb, prompt)[-1]
    first, diffs = None, []
    for step in range(args.steps):
        diffs.append((la - lb).abs().max().item())
        ta, tb = int(la.argmax()), int(lb.argmax())
        if ta != tb:
            first = step
            break
        la, lb = a.forward(sa, [ta])[0], b.forward(sb, [ta])[0]
    print("max |logit diff| per step:", " ".join(f"{d:.1e}" for d in diffs))
    print(f"logit scale {la.abs().max().item():.2f}; first greedy divergence: {first} (of {args.steps} steps)")


if __name__ == "__main__":
    main()
