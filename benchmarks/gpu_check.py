"""GPU correctness of the fast path on the `small` preset, in one process (prints a short table).

- teacher-forced: the fast path (CUDA graph, bucket 1) and the reference decode are fed the same
  tokens; per-step max |logit diff|.
- free-running greedy: both generate greedily from the same prompt; first step where the tokens
  differ (or none within --steps).
- determinism: the same greedy run twice gives the same logits bits; `--hash` prints the hash of
  a run so that two processes (a relaunch) can be compared.
- batch invariance: a sequence alone vs the same sequence as row 0 of a batch of 16.
- eager vs graph: one step both ways, bitwise.

python benchmarks/gpu_check.py [--steps 128] [--hash]
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from megastep.checkpoint.synthetic import preset, synthesize_weights
from megastep.model.fast import FastDecoder
from megastep.model.reference import ReferenceModel
from megastep.runtime.step import StepRunner


def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def fast_greedy(dec, runner, prompt, steps, slot=0):
    dec.pools.reset(slot)
    dev = dec.device
    logits, toks = [], []
    cur = None
    for t in range(len(prompt) + steps - 1):
        tok = prompt[t] if t < len(prompt) else toks[-1]
        lg, nt = runner.run(torch.tensor([tok], device=dev), torch.tensor([t], device=dev), torch.tensor([slot], device=dev))
        if t >= len(prompt) - 1:
            logits.append(lg[0].clone())
            toks.append(int(nt[0]))
        cur = lg
    del cur
    return toks, logits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--hash", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu runs the same checks eagerly with the torch refs")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = preset(args.preset, layers=args.layers)
    weights = synthesize_weights(cfg, seed=0, device=dev, include_mtp=False)
    dec = FastDecoder(cfg, weights, max_seqs=16, max_ctx=1024, device=dev)
    runner = StepRunner(dec.step, dev, dec.pools.dummy_slot, buckets=(1, 16))
    prompt = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()

    toks_a, logits_a = fast_greedy(dec, runner, prompt, args.steps)
    if args.hash:
        print("HASH", digest(logits_a))
        return 0
    rows = []
    toks_b, logits_b = fast_greedy(dec, runner, prompt, args.steps)
    rows.append(("same run twice: tokens equal", toks_a == toks_b))
    rows.append(("same run twice: logits bit-identical", all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))))
    print("HASH", digest(logits_a))

    # eager vs graph for one step on a fresh slot
    dec.pools.reset(1)
    t1 = torch.tensor([prompt[0]], device=dev)
    p0 = torch.tensor([0], device=dev)
    g_logits, _ = runner.run(t1, p0, torch.tensor([1], device=dev))
    g_logits = g_logits.clone()
    dec.pools.reset(1)
    e_logits = dec.step(t1, p0, torch.tensor([1], device=dev))
    rows.append(("eager vs graph: bit-identical", torch.equal(g_logits, e_logits)))

    # batch invariance: row 0 of a batch of 16 (15 other random sequences) vs alone
    others = torch.randint(0, cfg.vocab_size, (15, len(prompt) + 8), generator=torch.Generator().manual_seed(2))
    for s in range(16):
        dec.pools.reset(s)
    seq = prompt + toks_a[: min(8, args.steps - 1)]
    same = True
    maxd = 0.0
    for t in range(len(seq)):
        tokens = torch.tensor([seq[t]] + others[:, t].tolist(), device=dev)
        lg, _ = runner.run(tokens, torch.full((16,), t, device=dev), torch.arange(16, device=dev))
        if t >= len(prompt) - 1:
            alone = logits_a[t - len(prompt) + 1]
            same &= torch.equal(lg[0], alone)
            maxd = max(maxd, (lg[0] - alone).abs().max().item())
    rows.append(("alone vs batch of 16: bit-identical", same))
    rows.append(("alone vs batch of 16: max |diff|", f"{maxd:.3e}"))

    # the reference decode on the same device
    ref = ReferenceModel(cfg, weights, device=dev)
    st = ref.new_state()
    ref_logits = [ref.forward(st, prompt)[-1]]
    ref_toks = []
    for _ in range(args.steps - 1):
        ref_toks.append(int(ref_logits[-1].argmax()))
        ref_logits.append(ref.forward(st, [ref_toks[-1]])[0])
    ref_toks.append(int(ref_logits[-1].argmax()))
    first_diff = next((i for i, (a, b) in enumerate(zip(toks_a, ref_toks)) if a != b), None)
    rows.append((f"greedy tokens equal to the reference for {args.steps} steps", first_diff is None))
    rows.append(("first differing greedy step", first_diff))
    n_same = first_diff if first_diff is not None else args.steps
    d = torch.stack([(a - b).abs().max() for a, b in zip(logits_a[:n_same], ref_logits[:n_same])])
    scale = torch.stack(ref_logits[:n_same]).abs().max().item()
    rows.append(("logits |diff| vs reference while tokens agree: median / max / scale",
                 f"{d.median().item():.3e} / {d.max().item():.3e} / {scale:.2f}"))

    # teacher-forced: feed the reference tokens to the fast path too
    dec.pools.reset(2)
    seq = prompt + ref_toks[:-1]
    tf = []
    for t in range(len(seq)):
        lg, _ = runner.run(torch.tensor([seq[t]], device=dev), torch.tensor([t], device=dev), torch.tensor([2], device=dev))
        if t >= len(prompt) - 1:
            tf.append((lg[0] - ref_logits[t - len(prompt) + 1]).abs().max().item())
    tf = torch.tensor(tf)
    rows.append(("teacher-forced |diff|: median / p90 / max", f"{tf.median():.3e} / {tf.quantile(0.9):.3e} / {tf.max():.3e}"))

    print(f"\n== gpu_check ({args.preset} preset, {cfg.num_hidden_layers} layers, {dev}) ==")
    for k, v in rows:
        print(f"{k:<70} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
