"""Device-side sampling (runtime/sampling.py): counter-based noise, greedy, top-k/top-p cuts,
the sampled distribution, determinism and batch invariance."""

import torch

from megastep.runtime.sampling import sample, splitmix64, uniform_noise

MASK = (1 << 64) - 1


def splitmix64_py(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_splitmix64_matches_the_unsigned_definition():
    xs = [0, 1, 2, 12345, 2**40 + 7, 2**62, -1, -(2**63)]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & MASK for g in got] == [splitmix64_py(x & MASK) for x in xs]


def test_noise_is_in_the_open_unit_interval_and_keyed():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), 1000)
    assert ((u > 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform_noise(torch.tensor([1]), torch.tensor([5]), 1000)[0])


def rows(n, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long), torch.full((n,), top_p))


def test_temperature_zero_is_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 5.0, 2.0]])
    t, k, p = rows(2, temperature=0.0)
    assert sample(logits, t, k, p, torch.tensor([1, 2]), torch.tensor([0, 0])).tolist() == [1, 0]


def frequencies(logits_row, n, **kw):
    logits = logits_row.expand(n, -1)
    t, k, p = rows(n, **kw)
    toks = sample(logits, t, k, p, torch.arange(n), torch.arange(n) * 7)
    return torch.bincount(toks, minlength=logits.shape[1]).double() / n


def test_sampled_distribution_matches_softmax():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 0.0]])
    f = frequencies(logits, 40000, temperature=0.7)
    want = torch.softmax(logits[0].double() / 0.7, -1)
    assert (f - want).abs().max() < 0.01  # 40k draws: std of a frequency <= 0.0025


def test_top_k_and_top_p_cut_the_candidates():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    fk = frequencies(logits, 20000, top_k=2)
    assert fk[2] == 0 and fk[3] == 0 and abs(fk[0] - 0.5 / 0.8) < 0.015
    fp = frequencies(logits, 20000, top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 reaches it: keep two
    assert fp[2] == 0 and fp[3] == 0 and abs(fp[1] - 0.3 / 0.8) < 0.015
    f1 = frequencies(logits, 2000, top_p=0.4)  # the first candidate alone reaches 0.4
    assert f1[0] == 1.0


def test_row_alone_equals_row_in_batch_and_runs_repeat():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    t = torch.tensor([0.8, 0.0, 1.0, 1.3, 0.5, 1.0])
    k = torch.tensor([0, 0, 10, 0, 3, 50])
    p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.95])
    seed, pos = torch.arange(6) + 11, torch.arange(6) * 3
    batch = sample(logits, t, k, p, seed, pos)
    assert torch.equal(batch, sample(logits, t, k, p, seed, pos))
    for i in range(6):
        s = slice(i, i + 1)
        assert sample(logits[s], t[s], k[s], p[s], seed[s], pos[s]).item() == batch[i].item()


def test_step_runner_samples_per_row_and_pads_greedy():
    from megastep.runtime.step import StepRunner

    g = torch.Generator().manual_seed(1)
    table = torch.randn(8, 50, generator=g)  # "logits" of a toy step: a row per token id

    def step(tokens, pos, slots):
        return table[tokens] + 0.0 * pos[:, None]

    runner = StepRunner(step, torch.device("cpu"), dummy_slot=7, buckets=(4,), sampling=True)
    tokens, pos, slots = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    params = {"temperature": torch.tensor([1.0, 0.0, 0.7]), "top_k": torch.tensor([0, 0, 5]),
              "top_p": torch.tensor([0.9, 1.0, 1.0]), "seed": torch.tensor([3, 4, 5])}
    _, toks = runner.run(tokens, pos, slots, params)
    want = sample(table[tokens], params["temperature"], params["top_k"], params["top_p"], params["seed"], pos)
    assert torch.equal(toks, want)
    assert toks[1] == table[2].argmax()
    greedy_runner = StepRunner(step, torch.device("cpu"), dummy_slot=7, buckets=(4,))
    assert torch.equal(greedy_runner.run(tokens, pos, slots)[1], table[tokens].argmax(-1))
