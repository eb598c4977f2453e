"""Chat messages -> prompt text.

A checkpoint that ships a Jinja2 `chat_template` in tokenizer_config.json gets it rendered (in a
sandbox, with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`, `tools` and any
`chat_template_kwargs` from the request). Otherwise the built-in DeepSeek-V4 format below is used;
the official V4 tokenizer ships no template.

Built-in DeepSeek-V4 format (written from the published V4 encoding rules):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜></think>

  * BOS once at the very start; system content follows it directly (several system messages are
    concatenated in order); tools given on the request are rendered into the system part as the
    "## Tools" block with DSML tool-call syntax.
  * Each user turn is `<｜User｜>{content}`; a run of `tool` messages becomes one user turn of
    `<tool_result>{content}</tool_result>` blocks joined by a blank line.
  * An assistant turn is `{content}{tool calls}<｜end▁of▁sentence｜>`; the generation prompt after
    the last user turn is `<｜Assistant｜>`.
  * Non-thinking ("chat") mode, the default: `</think>` follows every `<｜Assistant｜>`, closing the
    reasoning block at once, so the model answers directly.
  * Thinking mode (`chat_template_kwargs: {"thinking": true}`): the generation prompt ends in
    `<think>`; assistant turns after the last user message keep `{reasoning_content}</think>`,
    earlier ones drop their reasoning (unless tools are in play, in which case all keep it);
    `reasoning_effort: "max"` prepends the official maximum-effort instruction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning inside {ts}...{te} BEFORE any tool calls or final response.

Otherwise, output directly after {te} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad role, bad content, a template that raised)."""


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ChatTemplateError(f"{where}: only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ChatTemplateError(f"{where}: content must be a string or a list of text parts")


def _render_tools(tools: list[dict]) -> str:
    fns = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            raise ChatTemplateError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        fns.append(_json(fn))
    return _TOOLS_BLOCK.format(d=DSML, ts=THINK_START, te=THINK_END, schemas="\n".join(fns))


def _render_tool_calls(calls: list[dict]) -> str:
    invokes = []
    for c in calls:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        name, raw = fn.get("name"), fn.get("arguments", "{}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(args, dict):
                raise ValueError
        except ValueError:
            args = {"arguments": raw}
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def encode_dsv4(messages: list[dict], *, thinking: bool = False, tools: list[dict] | None = None,
                reasoning_effort: str | None = None, add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style messages in the DeepSeek-V4 prompt format (see the module docstring)."""
    # Merge runs of tool results into user turns, as the V4 format has no tool role.
    turns: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role in ("user", "tool"):
            text = _text(m.get("content"), f"messages[{i}]")
            if role == "tool":
                text = f"<tool_result>{text}</tool_result>"
            if turns and turns[-1]["role"] == "user" and turns[-1].get("merged"):
                turns[-1]["content"] += "\n\n" + text   # consecutive user/tool messages: one turn
            else:
                turns.append({"role": "user", "content": text, "merged": True})
        elif role in ("system", "developer", "assistant", "latest_reminder"):
            turns.append({**m, "content": _text(m.get("content"), f"messages[{i}]")})
        else:
            raise ChatTemplateError(f"messages[{i}].role must be system, user, assistant or tool (got {role!r})")
    if not any(t["role"] in ("user", "developer") for t in turns):
        raise ChatTemplateError("messages must contain at least one user message")
    has_tools = bool(tools)
    drop_thinking = not has_tools
    last_user = max(i for i, t in enumerate(turns) if t["role"] in ("user", "developer"))

    out = [BOS]
    if thinking and reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX)
    tools_done = False
    for i, t in enumerate(turns):
        role, content = t["role"], t["content"]
        if role == "system":
            out.append(content)
            if tools and not tools_done:
                out.append("\n\n" + _render_tools(tools))
                tools_done = True
        elif role in ("user", "developer"):
            out.append(USER + content)
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + content)
        elif role == "assistant":
            calls = t.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatTemplateError("tool_calls must be a list")
            if thinking and (not drop_thinking or i > last_user):
                reasoning = t.get("reasoning_content") or ""
                out.append(reasoning + THINK_END)
            out.append(content + (_render_tool_calls(calls) if calls else "") + EOS)
        # the assistant prefix goes after a user turn unless the next turn is its reminder
        nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
            if nxt is None and not add_generation_prompt:
                continue
            out.append(ASSISTANT)
            out.append(THINK_START if thinking and (not drop_thinking or i >= last_user) else THINK_END)
    if tools and not tools_done:  # no system message: tools go in front of the first turn
        out.insert(1, _render_tools(tools) + "\n\n")
    return "".join(out)


class ChatRenderer:
    """Renders a chat request with the checkpoint's template, or the built-in V4 format."""

    def __init__(self, model_dir: str | Path | None, bos_token: str = BOS, eos_token: str = EOS) -> None:
        self.template_source: str | None = None
        self.bos_token, self.eos_token = bos_token, eos_token
        if model_dir is not None:
            cfg_path = Path(model_dir) / "tokenizer_config.json"
            if cfg_path.is_file():
                try:
                    tc = json.loads(cfg_path.read_text())
                except (ValueError, UnicodeDecodeError):
                    tc = {}
                tpl = tc.get("chat_template") if isinstance(tc, dict) else None
                if isinstance(tpl, list):  # HF also allows [{"name": "default", "template": ...}]
                    tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
                if isinstance(tpl, str) and tpl.strip():
                    self.template_source = tpl
        self._template = None
        if self.template_source is not None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise ChatTemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            try:
                self._template = env.from_string(self.template_source)
            except TemplateError as e:
                raise ValueError(f"tokenizer_config.json chat_template does not compile: {e}") from None

    @property
    def kind(self) -> str:
        return "checkpoint chat_template" if self._template is not None else "built-in DeepSeek-V4 format"

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               kwargs: dict[str, Any] | None = None) -> str:
        kwargs = dict(kwargs or {})
        if self._template is None:
            thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
            effort = kwargs.get("reasoning_effort")
            try:
                return encode_dsv4(messages, thinking=thinking, tools=tools,
                                   reasoning_effort=effort if effort in ("max", "high") else None)
            except (AttributeError, TypeError, KeyError) as e:   # odd shapes inside tools / tool_calls
                raise ChatTemplateError(f"cannot render these messages: {type(e).__name__}: {e}") from None
        from jinja2.exceptions import TemplateError
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from None
