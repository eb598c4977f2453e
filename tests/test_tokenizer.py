"""Tokenizer files: the official copy, the byte-level fallback, and clear errors."""

import pytest

from megastep.config import ModelConfig
from megastep.errors import CheckpointError
from megastep.tokenizer import byte_level_tokenizer, load_tokenizer, write_tokenizer


def test_official_tokenizer_copy(tmp_path):
    assert write_tokenizer(ModelConfig(), tmp_path) == "official"
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 129280)
    ids = tok.encode("Hello, world")
    assert ids and 0 not in ids  # no BOS added behind the caller's back
    assert tok.decode(ids) == "Hello, world"
    assert tok.encode("<｜begin▁of▁sentence｜>hi")[0] == 0


def test_byte_level_tokenizer_places_specials_at_config_ids(tmp_path):
    cfg = ModelConfig(vocab_size=300, bos_token_id=5, eos_token_id=299)
    assert write_tokenizer(cfg, tmp_path) == "bytes"
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (5, 299, 300)
    text = "naïve 日本 \n\t✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and 5 not in ids and 299 not in ids
    assert tok.decode(ids) == text
    assert tok.decode([5] + ids + [299]) == text
    assert tok.decode([5] + ids, skip_special_tokens=False).startswith("<｜begin▁of▁sentence｜>")


def test_byte_level_tokenizer_limits(tmp_path):
    with pytest.raises(ValueError, match="259"):
        byte_level_tokenizer(258, 0, 1)
    with pytest.raises(ValueError, match="differ"):
        byte_level_tokenizer(300, 1, 1)
    assert write_tokenizer(ModelConfig(vocab_size=128), tmp_path) is None
    with pytest.raises(CheckpointError, match="129280"):
        write_tokenizer(ModelConfig(vocab_size=512), tmp_path, "official")


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
