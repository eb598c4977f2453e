"""The command line: make-checkpoint -> inspect -> generate, scripted generation, and one clear
message (exit status 2, no traceback) for every user mistake."""

import json
import subprocess
import sys

import pytest

from megastep.cli import main


def run(*argv: str) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "megastep.cli", *argv], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    assert main(["make-checkpoint", "--preset", "small", "--layers", "2", "--seed", "3", "--out", str(d)]) == 0
    return d


def test_make_checkpoint_inspect_generate(small_dir, capsys):
    assert json.loads((small_dir / "config.json").read_text())["num_hidden_layers"] == 2
    assert (small_dir / "model.safetensors.index.json").exists()
    assert (small_dir / "tokenizer.json").exists()

    assert main(["inspect", str(small_dir)]) == 0
    plan = capsys.readouterr().out
    assert "csa" in plan.lower() and "float8_e4m3fn" in plan.lower().replace("f8_e4m3", "float8_e4m3fn")

    assert main(["generate", "--model", str(small_dir), "--max-new-tokens", "4", "hello"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_prompt_ids_print_ids_greedy_is_deterministic(small_dir, capsys):
    argv = ["generate", "--model", str(small_dir), "--prompt-ids", "3,17,42", "--print-ids", "--max-new-tokens", "6"]
    assert main(argv) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(argv) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    ids = [int(t) for t in first.split(",")]
    assert first == second and 1 <= len(ids) <= 6


def test_sampling_same_seed_same_tokens(small_dir, capsys):
    def sample(seed: str) -> str:
        argv = ["generate", "--model", str(small_dir), "--prompt-ids", "5,6", "--print-ids", "--max-new-tokens", "8",
                "--temperature", "1.0", "--seed", seed]
        assert main(argv) == 0
        return capsys.readouterr().out.strip().splitlines()[-1]

    assert sample("1") == sample("1")
    assert sample("1") != sample("2")


def test_no_quant_sim_flag_changes_numerics_not_interface(small_dir, capsys):
    argv = ["generate", "--model", str(small_dir), "--prompt-ids", "3,17,42", "--print-ids", "--max-new-tokens", "3"]
    assert main(argv + ["--no-quant-sim"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()[-1].split(",")) >= 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "/nonexistent/model"),
        (["generate", "--model", "{small}", "   "], "empty prompt"),
        (["generate", "--model", "{small}", "--prompt-ids", ""], "empty prompt"),
        (["generate", "--model", "{small}", "--prompt-ids", "1,x"], "comma-separated integers"),
        (["generate", "--model", "{small}", "--prompt-ids", "1", "--max-new-tokens", "2000000"], "limit"),
        (["generate", "--model", "{small}", "--prompt-ids", "999999999"], "outside the vocabulary"),
        (["generate", "--model", "{small}", "--temperature", "-1", "hi"], "temperature"),
        (["inspect", "/nonexistent/model"], "/nonexistent/model"),
        (["make-checkpoint", "--preset", "huge", "--out", "/tmp/x"], "unknown preset"),
        (["bench", "--batch", "1,6", "--block", "4"], "multiple of it"),
        # the preset and its layers are checked before the device (a CPU machine names the typo, not the GPU)
        (["bench", "--preset", "huge"], "unknown preset 'huge'"),
        (["bench", "--layers", "99"], "--layers must be in 1..43"),
        (["bench", "--gpus", "0,1,2"], "cannot split 256 routed experts evenly over 3"),
        (["serve", "--model", "{small}", "--hbm-budget", "10"], "for the fast engine"),
        (["bench", "--gpus", "0,1", "--hbm-budget", "100"], "drop --hbm-budget"),
        (["serve", "--model", "{small}", "--gpus", "0,1,2"], "routed experts evenly over 3 ranks"),
        (["serve", "--model", "{small}", "--gpus", "0,63"], "this machine has"),
        (["serve", "--gpus", "0,1", "--device", "cuda"], "drop --device"),
        (["serve", "--gpus", "0,1", "--engine", "reference"], "drop --engine reference"),
        (["serve", "--gpus", "0,x"], "comma-separated GPU ids"),
        (["bench", "--batch", "1,x"], "comma-separated row counts"),
        (["bench", "--batch", "0,4"], "comma-separated row counts"),
        (["bench", "--gpus", "0,1", "--batch", "x"], "comma-separated row counts"),
        (["bench", "--attn-split", "on"], "--attn-split on splits the attention's heads over GPUs"),
        (["bench", "--gpus", "0", "--vocab-split", "on"], "--vocab-split on splits the lm head's vocabulary over GPUs"),
        (["serve", "--model", "{small}", "--port", "99999"], "--port must be in 0..65535"),
        (["serve", "--model", "{small}", "--prefill-block", "0"], "--prefill-block must be >= 1"),
        (["generate", "--model", "{small}", "--top-p", "2", "hi"], "--top-p must be in (0, 1]"),
        (["generate", "--model", "{small}", "--top-k", "-1", "hi"], "--top-k must be >= 0"),
        # outputs that cannot be written: refused before the work, not after it
        (["bench", "--json", "/nonexistent/dir/r.json"], "no such folder"),
        (["bench", "--json", "{small}"], "is a folder"),
        (["profile-routing", "--model", "{small}", "--prompt-ids", "1,2", "--out", "/nonexistent/p.json"], "no such folder"),
        (["profile-routing", "--model", "/nonexistent", "--prompts", "/nonexistent.txt", "--out", "p.json"],
         "model directory /nonexistent does not exist"),
        (["make-checkpoint", "--preset", "tiny", "--out", "{small}/config.json"], "a file is in the way"),
        (["make-checkpoint", "--preset", "tiny", "--out", "{small}/config.json/sub"], "cannot write into"),
    ],
)
def test_user_errors_are_one_clear_message(small_dir, argv, message):
    argv = [a.replace("{small}", str(small_dir)) for a in argv]
    r = run(*argv)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 12  # one message (a listing of problems at most)


def test_prompt_longer_than_the_model_limit(tmp_path):
    from megastep.checkpoint.synthetic import preset, write_checkpoint

    cfg = preset("tiny", layers=1).replace(max_position_embeddings=8)
    write_checkpoint(cfg, tmp_path, seed=0)
    r = run("generate", "--model", str(tmp_path), "--prompt-ids", ",".join(["5"] * 9), "--max-new-tokens", "0")
    assert r.returncode == 2 and "exceeds the model's limit" in r.stderr and "Traceback" not in r.stderr


def test_profile_routing_then_inspect_with_budget(small_dir, tmp_path, capsys):
    prof = tmp_path / "profile.json"
    assert main(["profile-routing", "--model", str(small_dir), "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8",
                 "--out", str(prof)]) == 0
    assert prof.exists()
    capsys.readouterr()
    assert main(["inspect", str(small_dir), "--hbm-budget", "100", "--routing-profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "expert placement" in out and "cold share" in out


def test_inspect_budget_below_resident_weights_is_a_user_error(small_dir):
    r = run("inspect", str(small_dir), "--hbm-budget", "0.01")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "HBM budget" in r.stderr
