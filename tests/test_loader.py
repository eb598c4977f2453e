"""Loading checkpoints: the round trip, and one clear error for every kind of bad input."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megastep.checkpoint.loader import (
    CheckpointConfigError, describe_plan, load_checkpoint, open_checkpoint, read_shard_header, scan_checkpoint,
)
from megastep.checkpoint.synthetic import preset, synthesize_weights, write_checkpoint
from megastep.checkpoint.tensors import DTYPE_NAMES, expected_tensors
from megastep.config import ModelConfig
from megastep.errors import CheckpointError, ConfigError

MICRO = preset("tiny", layers=3).replace(vocab_size=512, num_nextn_predict_layers=1)
SEED = 3
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "model"
    write_checkpoint(MICRO, d, seed=SEED, shard_bytes=150_000)
    return d


@pytest.fixture
def ck(written, tmp_path):
    """A private copy of the written checkpoint, for a test to damage."""
    d = tmp_path / "model"
    shutil.copytree(written, d)
    return d


def same(a, b):
    raw = (lambda t: t.view(torch.uint8)) if a.dtype.itemsize == 1 else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def shard_of(d, name):
    return d / json.loads((d / INDEX).read_text())["weight_map"][name]


def edit_shard(d, name, edit):
    """Rewrite the shard holding `name` after edit(tensors) changed its tensor dict."""
    path = shard_of(d, name)
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_index(d, edit):
    index = json.loads((d / INDEX).read_text())
    edit(index["weight_map"])
    (d / INDEX).write_text(json.dumps(index))


def load_error(d, *pieces, cls=CheckpointError, **kw) -> str:
    with pytest.raises(cls) as e:
        load_checkpoint(d, progress=False, **kw)
    msg = str(e.value)
    for p in pieces:
        assert p in msg, f"{p!r} not in:\n{msg}"
    return msg


# ---- good checkpoints ------------------------------------------------------------------------
def test_round_trip(written):
    ref = synthesize_weights(MICRO, SEED)
    cfg, w = load_checkpoint(written, progress=False)
    assert cfg == MICRO
    assert list(w) == [n for n in expected_tensors(MICRO) if not n.startswith("mtp.")]
    assert all(same(w[n], ref[n]) for n in w)
    _, with_mtp = load_checkpoint(written, include_mtp=True, progress=False)
    assert list(with_mtp) == list(ref) and all(same(with_mtp[n], ref[n]) for n in ref)


def test_open_checkpoint_reads_lazily(written, ck):
    """The lazy mapping: the same names and tensors as load_checkpoint, read on access; deleted
    names are gone; a shard damaged after validation gives a CheckpointError on access."""
    _, eager = load_checkpoint(written, progress=False)
    cfg, lazy = open_checkpoint(written)
    assert cfg == MICRO and list(lazy) == list(eager)
    assert lazy.nbytes() == {n: t.numel() * t.element_size() for n, t in eager.items()}
    assert all(same(lazy[n], eager[n]) for n in reversed(list(eager)))
    first = next(iter(lazy))
    del lazy[first]
    assert first not in lazy and len(lazy) == len(eager) - 1
    with pytest.raises(KeyError):
        lazy[first]
    _, damaged = open_checkpoint(ck)
    name = "layers.1.attn.wq_b.weight"
    shard_of(ck, name).write_bytes(b"")  # gone after the headers were checked
    with pytest.raises(CheckpointError, match="cannot read"):
        damaged[name]


def test_single_file_checkpoint(tmp_path):
    cfg = MICRO.replace(num_nextn_predict_layers=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    ref = synthesize_weights(cfg, 1)
    save_file(ref, str(tmp_path / "model.safetensors"))
    got_cfg, w = load_checkpoint(tmp_path, progress=False)
    assert got_cfg == cfg and all(same(w[n], ref[n]) for n in ref)


def test_no_mtp_tensors_is_fine_unless_asked_for(ck):
    shards = set(json.loads((ck / INDEX).read_text())["weight_map"].values())
    for s in shards:
        t = load_file(str(ck / s))
        save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, str(ck / s))
    edit_index(ck, lambda m: [m.pop(k) for k in list(m) if k.startswith("mtp.")])
    load_checkpoint(ck, progress=False)
    load_error(ck, "missing tensors (87)", "mtp.0.attn_norm.weight", include_mtp=True)


def test_unquantized_and_fp32_exports_load(tmp_path):
    d = tmp_path / "u"
    write_checkpoint(MICRO, d, seed=SEED, unquantized=True, tokenizer="none")
    cfg, w = load_checkpoint(d, progress=False)
    assert cfg.quantization_config is None and w["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    # transformers may export in float32: every BF16 tensor may be F32 then.
    edit_shard(d, "layers.0.attn.wq_a.weight", lambda t: t.update({k: v.float() for k, v in t.items()
                                                                    if v.dtype == torch.bfloat16}))
    _, w32 = load_checkpoint(d, progress=False)
    assert w32["layers.0.attn.wq_a.weight"].dtype == torch.float32
    assert torch.equal(w32["layers.0.attn.wq_a.weight"], w["layers.0.attn.wq_a.weight"].float())


# ---- bad checkpoints: one test per problem ---------------------------------------------------
def test_truncated_shard(ck):
    path = shard_of(ck, "embed.weight")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    load_error(ck, f"{path.name} is truncated")


def test_corrupted_header_bytes(ck):
    path = shard_of(ck, "layers.1.attn.wq_a.weight")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage!")
    msg = load_error(ck, f"{path.name} has a corrupt header", "cannot be checked")
    assert "missing tensors" not in msg  # the lost tensors are not listed one by one


def test_corrupted_header_length(ck):
    path = shard_of(ck, "layers.1.attn.wq_a.weight")
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    load_error(ck, f"{path.name} is corrupt")


def test_missing_tensor(ck):
    name = "layers.1.attn.indexer.weights_proj.weight"
    edit_shard(ck, name, lambda t: t.pop(name))
    edit_index(ck, lambda m: m.pop(name))
    load_error(ck, "missing tensors (1)", name)


def test_tensor_listed_in_index_but_not_in_shard(ck):
    name = "layers.2.attn.compressor.ape"
    edit_shard(ck, name, lambda t: t.pop(name))
    load_error(ck, "places tensors in shards that do not hold them", name)


def test_unexpected_tensor(ck):
    anchor = "layers.0.attn.attn_sink"
    edit_shard(ck, anchor, lambda t: t.update({"layers.0.attn.extra_bias": torch.zeros(4)}))
    edit_index(ck, lambda m: m.update({"layers.0.attn.extra_bias": shard_of(ck, anchor).name}))
    load_error(ck, "unexpected tensors (1)", "layers.0.attn.extra_bias")


def test_wrong_dtype(ck):
    name = "layers.1.attn.wkv.weight"
    edit_shard(ck, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    load_error(ck, "wrong dtype", f"{name} is BF16, expected F8_E4M3")


def test_wrong_shape(ck):
    name = "layers.2.attn.attn_sink"
    edit_shard(ck, name, lambda t: t.update({name: torch.zeros(7)}))
    load_error(ck, "wrong shape", f"{name} is [7], expected [4]")


def test_config_that_does_not_match_the_tensors(ck):
    raw = json.loads((ck / "config.json").read_text())
    raw["hidden_size"] = 256
    (ck / "config.json").write_text(json.dumps(raw))
    load_error(ck, "config.json does not match the tensors", "hidden_size 256", "wrong shape")


def test_shard_listed_but_absent(ck):
    path = shard_of(ck, "head.weight")
    path.unlink()
    load_error(ck, "listed in model.safetensors.index.json but absent", path.name)


def test_model_dir_does_not_exist(tmp_path):
    load_error(tmp_path / "nope", "does not exist")


def test_missing_config(ck):
    (ck / "config.json").unlink()
    load_error(ck, "no config.json", cls=ConfigError)


def test_invalid_config_json(ck):
    (ck / "config.json").write_text('{"model_type": "deepseek_v4",')
    load_error(ck, "config.json is not valid JSON")


def test_v41_not_supported_yet(ck):
    (ck / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {}}))
    msg = load_error(ck, "not supported yet", cls=ConfigError)
    assert "missing tensors" not in msg


def test_unknown_model_type(ck):
    (ck / "config.json").write_text(json.dumps({"model_type": "llama"}))
    load_error(ck, "unknown model_type 'llama'", cls=CheckpointConfigError)


def test_no_weights_and_invalid_index(tmp_path, written):
    shutil.copyfile(written / "config.json", tmp_path / "config.json")
    load_error(tmp_path, "no model.safetensors.index.json or model.safetensors")
    (tmp_path / INDEX).write_text("[1, 2")
    load_error(tmp_path, "model.safetensors.index.json is not valid")


def test_every_problem_in_one_message(ck):
    (ck / "config.json").unlink()
    truncated = shard_of(ck, "embed.weight")
    with open(truncated, "r+b") as f:
        f.truncate(1000)
    absent = shard_of(ck, "head.weight")
    absent.unlink()
    load_error(ck, "no config.json", f"{truncated.name} is truncated", absent.name, cls=CheckpointError)


# ---- headers and inspect ----------------------------------------------------------------------
def test_describe_plan(written):
    text = describe_plan(written)
    for piece in ("3 layers + 1 MTP", "sliding 1 (0)", "csa 1 (1)", "hca 1 (2)", "hash 1 (0)",
                  "by dtype", "F8_E4M3", "routed_expert", "per token of context", "check: OK"):
        assert piece in text, piece


def test_describe_plan_reports_problems(ck):
    name = "layers.1.attn.wkv.weight"
    edit_shard(ck, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    assert "wrong dtype" in describe_plan(ck)


def _sparse_files_work(path) -> bool:
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    ok = os.stat(path).st_blocks * 512 < (1 << 20)
    os.unlink(path)
    return ok


def test_full_v4_flash_checkpoint_from_headers_only(tmp_path):
    """A 160 GB V4-Flash checkpoint made of real headers and sparse (unwritten) data: scanning
    and inspect read headers only, so they are instant and need no disk space."""
    if not _sparse_files_work(tmp_path / "probe"):
        pytest.skip("filesystem without sparse files")
    cfg = ModelConfig()
    table = expected_tensors(cfg)
    names = list(table)
    n_shards = 4
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        header, off = {}, 0
        for n in names[i::n_shards]:
            s = table[n]
            header[n] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
            off += s.nbytes
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        with open(tmp_path / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + off)
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    scan = scan_checkpoint(tmp_path)
    assert scan.all_problems(require_mtp=True) == []
    text = describe_plan(tmp_path)
    assert "43 layers + 1 MTP" in text and "sliding 2 (0, 1)" in text and "csa 21 (2-42 step 2)" in text
    assert "hca 20 (3-41 step 2)" in text and "hash 3 (0, 1, 2)" in text and "check: OK" in text
    tensors, problem = read_shard_header(tmp_path / "model-00001-of-00004.safetensors")
    assert problem is None and len(tensors) == len(names[0::n_shards])
