"""benchmarks/kernels/precompile.py: a step's Triton kernels compiled for an H200 into a Triton cache
on a machine without a GPU (Triton's own launcher, a stand-in sm_90 driver, every launch a warm-up),
here on a tiny model with the installed Triton. A second pass finds every kernel in the cache (the
keys are stable across passes and processes), an arm compiles its own kernels and is put back, the
step takes the GPU's paths (the Triton neighbours of the CUDA C++ experts and routing, not the
Triton experts and router; the side streams' launches of MHC_SINKHORN_BESIDE_ROWS, INDEXER_BESIDE_ROWS
and INDEXER_FIRST, all on at 1 row), and everything the tool patched is restored. Runs in a process of
its own: the compile needs Triton without the interpreter."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia")
HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "benchmarks", "kernels")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = [{kernels!r}, {tests!r}]
    import precompile as PC, kernel_lint as KL, torch, triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from test_fast_step_triton import tiny_cfg
    from megastep.checkpoint.synthetic import synthesize_weights
    from megastep.model.fast import FastDecoder

    cache = os.environ["TRITON_CACHE_DIR"]
    run, stream = JITFunction.run, torch.cuda.current_stream
    KL.gpu_launch_options(PC.SMS)
    cfg = tiny_cfg(o_lora_rank=128).replace(vocab_size=1024)  # (bench's rows draw ids below 1000)
    dec = FastDecoder(cfg, synthesize_weights(cfg, seed=0, device="cpu", include_mtp=False), max_seqs=2,
                      max_ctx=72, device="cpu", triton=True)
    def pdl_of(d):  # the entry's launch_pdl compile option, from its metadata
        js = [x for x in os.listdir(os.path.join(cache, d)) if x.endswith(".json") and not x.startswith("__grp__")]
        meta = json.load(open(os.path.join(cache, d, js[0])))
        assert (meta["target"]["backend"], meta["target"]["arch"]) == ("cuda", 90), meta["target"]
        return meta["launch_pdl"]

    out = {{"new": [], "launched": []}}
    import megastep.model.fast as f
    pins = (f.PDL_MAX_ROWS, f.MHC_SINKHORN_BESIDE_ROWS, f.INDEXER_FIRST, f.INDEXER_BESIDE_ROWS)
    arms = [("default", ""), ("default", ""), ("nopdl", "import megastep.model.fast as f; f.PDL_MAX_ROWS = 0"),
            ("default", ""), ("hc_inline", "import megastep.model.fast as f; f.MHC_SINKHORN_BESIDE_ROWS = 0"),
            ("idx_off", "import megastep.model.fast as f; f.INDEXER_FIRST = False"),
            ("beside_off", "import megastep.model.fast as f; f.INDEXER_BESIDE_ROWS = 0")]
    for name, code in arms:
        seen = PC.triton_entries(cache)
        launched = PC.compile_steps(dec, [1], [(name, code)], 8, cache, log=lambda m: None)
        out["new"].append(sorted(pdl_of(d) for d in PC.triton_entries(cache) - seen))
        out["launched"].append(dict(launched))
    out["layers"], out["csa_layers"] = cfg.num_hidden_layers, cfg.compress_ratios.count(4)
    out["restored"] = [JITFunction.run is run, torch.cuda.current_stream is stream, driver._active is None,
                       dec.side_stream is None, dec.moe_mode is None,
                       (f.PDL_MAX_ROWS, f.MHC_SINKHORN_BESIDE_ROWS, f.INDEXER_FIRST, f.INDEXER_BESIDE_ROWS) == pins]
    print(json.dumps(out))
""")


def test_compiles_a_gpu_shaped_step_into_the_cache_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = SCRIPT.format(kernels=KERNELS, tests=os.path.join(HERE, "kernels"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.join(HERE, ".."))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, again, nopdl, back, hc_inline, _, _ = out["new"]
    assert len(first) > 10 and again == [] and back == [], out["new"]  # compiled once, found after
    # launch_pdl is a compile option: the arm without PDL compiles a twin of each PDL launch, and only those
    assert True in first and nopdl == [False] * first.count(True), out["new"]
    launched = out["launched"][0]
    assert out["launched"][1] == launched and out["launched"][3] == launched
    # the H200's paths: the CUDA C++ experts and routing (their launches skipped) with the Triton
    # activation quantization between the experts' launches; the greedy tokens' launch
    assert launched.get("_moe_act_quant_kernel") and launched.get("_argmax_kernel"), launched
    for cpu_only in ("_moe_gate_up_kernel", "_moe_down_kernel", "_route_kernel", "_route_group_kernel",
                     "_gate_route_group_kernel"):
        assert cpu_only not in launched, launched
    # the side streams' arms on the H200's paths, each changing only its own launches: every sublayer's
    # Sinkhorn in a launch of its own beside (MHC_SINKHORN_BESIDE_ROWS: the arm without it has one mHC
    # finish launch fewer per sublayer, and nothing new compiles), a CSA layer's indexer rows in a launch
    # of their own (INDEXER_FIRST: one launch fewer without it), the qr group in two launches with the
    # indexer's beside (INDEXER_BESIDE_ROWS: without it, one FP8 and one bf16 launch fewer per CSA layer)
    csa, fp8, bf16 = out["csa_layers"], launched["_linear_fp8_kernel"], launched["_linear_bf16_kernel"]
    hc_off, idx_off, beside_off = out["launched"][4:7]
    assert hc_inline == [] and hc_off == {**launched, "_hc_finish_kernel": launched["_hc_finish_kernel"]
                                          - 2 * out["layers"]}, hc_off
    assert idx_off == {**launched, "_linear_bf16_kernel": bf16 - csa}, idx_off
    assert beside_off == {**launched, "_linear_fp8_kernel": fp8 - csa, "_linear_bf16_kernel": bf16 - csa}, beside_off
    assert all(out["restored"]), out["restored"]


def test_pack_keeps_what_a_cache_hit_reads(tmp_path):
    sys.path.insert(0, KERNELS)
    import tarfile

    import precompile as PC

    root, cuda = tmp_path / "megastep-device-cache", tmp_path / "cuda"
    entry = root / "triton" / "KEY"
    entry.mkdir(parents=True)
    cuda.mkdir()
    names = ["k.json", "k.cubin", "k.ptx", "k.ttir", "k.ttgir", "k.llir", "k.source", "__grp__k.json"]
    for n in names:
        (entry / n).write_text(n)
    (cuda / "abc.cubin").write_text("cubin")
    (cuda / "abc.tmp").write_text("a partial build")
    line = PC.pack(str(tmp_path / "out.tgz"), str(root), str(cuda))
    with tarfile.open(tmp_path / "out.tgz") as tar:
        members = {m.name for m in tar.getmembers() if m.isfile()}
    top = "megastep-device-cache"
    assert members == {f"{top}/triton/KEY/{n}" for n in ("k.json", "k.cubin", "k.ptx", "__grp__k.json")} | {
        f"{top}/cuda/abc.cubin", f"{top}/triton_key.txt"}, members
    assert (root / "triton_key.txt").read_text().strip() == PC.key()
    assert "1 Triton kernels and 1 CUDA C++ cubins" in line, line
