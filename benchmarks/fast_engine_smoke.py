"""FastEngine on a GPU (the engine `megastep serve --engine fast` uses): four requests of different
prompt lengths decoded greedily together, each compared with the same request run alone.

python benchmarks/fast_engine_smoke.py
"""

import tempfile

import torch

from megastep.checkpoint.synthetic import preset, write_checkpoint
from megastep.runtime.engine import FastEngine


def greedy(engine, prompts, steps):
    seqs = [engine.new_sequence() for _ in prompts]
    rows = [(s, list(p)) for s, p in zip(seqs, prompts)]
    outs = [[] for _ in prompts]
    for _ in range(steps):
        logits = engine.forward_batch(rows)
        rows = []
        for i, (s, lg) in enumerate(zip(seqs, logits)):
            t = int(torch.argmax(lg))
            outs[i].append(t)
            rows.append((s, [t]))
    for s in seqs:
        engine.free(s)
    return outs


def main():
    d = tempfile.mkdtemp()
    write_checkpoint(preset("small", layers=2), d, seed=0, tokenizer="none")  # the engine needs no tokenizer
    eng = FastEngine(d, device="cuda", max_seqs=4, max_ctx=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (3, 9, 1, 17)]
    together = greedy(eng, prompts, 12)
    alone = [greedy(eng, [p], 12)[0] for p in prompts]
    print("together == alone for every request:", together == alone)
    print("live sequences after:", eng.live_sequences)


if __name__ == "__main__":
    main()
