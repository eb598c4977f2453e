"""benchmarks/kernels/tune_dense.py (the BF16 linear's configuration sweep): the step's shapes, its
candidates at them, and the whole sweep on tiny shapes under the interpreter (--smoke: every
candidate checked against the ref and timed, a winner printed); tune.py pins its winners into
dense._PINNED as a literal that reads back."""

import ast
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "..", "benchmarks", "kernels")
sys.path.insert(0, KERNELS)
import tune as TUNE  # noqa: E402
import tune_dense as T  # noqa: E402

from megastep.config import ModelConfig  # noqa: E402
from megastep.kernels import dense  # noqa: E402
from megastep.kernels.dense import DenseConfig  # noqa: E402


def test_the_steps_shapes():
    # the concatenations of model/fast.py's x_dense (CSA: compressor + indexer compressor +
    # weights_proj; HCA: compressor) and the router's gate, at K = hidden
    assert T.shapes(ModelConfig()) == {"csa_x_dense": (2624, 4096), "hca_x_dense": (1024, 4096), "gate": (256, 4096)}


@pytest.mark.parametrize("N,K", [(2624, 4096), (1024, 4096), (256, 4096)])
def test_candidates(N, K):
    cands = T.candidates(N, K)
    assert cands[0] == dense.pick_config(N, K) and len(set(cands)) == len(cands) >= 8
    programs = set()
    for c in cands:
        c.check()
        split, per = dense.split_plan(K, c)
        assert split == c.split_k and per % c.block_k == 0  # no empty split
        programs.add(-(-N // c.block_n) * split)
    # the grid reaches 2, 4 and 8 programs per SM of an H200 (within a factor of 2 of each target),
    # or as many as the shape has (16-channel tiles x 128-wide K steps)
    most = -(-N // 16) * -(-K // 128)
    assert all(any(t / 2 < p <= t for p in programs) or most in programs for t in T.TARGETS), sorted(programs)


def test_smoke_sweep_checks_and_times_every_candidate(tmp_path):
    out = tmp_path / "dense.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(KERNELS, "tune_dense.py"), "--smoke", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    lines = [ln for ln in got["log"] if ln.lstrip().startswith("bn ")]
    n_cands = sum(len(T.candidates(N, K, smoke=True)) for N, K in ((200, 512), (48, 256)))
    assert len(lines) == n_cands and not any("failed" in ln for ln in lines), lines
    assert all("score" in ln for ln in lines)
    for key, cfg in got["winners"].items():  # winners are valid configurations of their shape
        N, K = ast.literal_eval(key)
        c = DenseConfig(**cfg)
        c.check()
        assert dense.split_plan(K, c)[0] == c.split_k


def test_tune_pins_dense_winners(tmp_path):
    assert TUNE.TUNERS["dense"] == ("tune_dense", "megastep.kernels.dense")
    src = tmp_path / "dense.py"
    src.write_text(open(dense.__file__).read())
    # the module's class at run time: kernels/conftest.py and test_dense.py reload dense under the
    # interpreter, after which the name imported above is another class, whose instances never
    # equal the table's
    table = {**dense._PINNED, (2624, 4096): dense.DenseConfig(32, 256, 8)}
    TUNE.rewrite_pinned(src, table)
    ns = {"DenseConfig": dense.DenseConfig}
    tree = ast.parse(src.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_PINNED")
    assert eval(compile(ast.Expression(node.value), "dense.py", "eval"), ns) == table
