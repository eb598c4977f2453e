"""OpenAI request validation and error bodies.

Every problem with a request becomes an `APIError`, answered as
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, the way the OpenAI API does.
Validation is written out by hand (not pydantic) so each message names the field and the rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 4


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """What both endpoints reduce to, before tokenization."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    user: str | None = None
    # completions
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # chat
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", code="invalid_json")
    return body


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    if name not in body or body[name] is None:
        return default
    v = body[name]
    # JSON true/false are not numbers here, even though bool subclasses int in Python
    if isinstance(v, bool) and bool not in kinds:
        raise bad(f"'{name}' must be {what}, got {_type_name(v)}", param=name, code="invalid_type")
    if not isinstance(v, kinds):
        raise bad(f"'{name}' must be {what}, got {_type_name(v)}", param=name, code="invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be a finite number", param=name, code="invalid_value")
    return v


def _common(body: dict, served_names: set[str]) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_type_name(model)}", param="model", code="invalid_type")
    if model not in served_names:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       f"{', '.join(sorted(served_names))}", param="model", code="model_not_found")
    stream = _get(body, "stream", (bool,), False, "a boolean")
    so = _get(body, "stream_options", (dict,), {}, "an object")
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", param="stream_options", code="invalid_type")
    if so and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    max_tokens = _get(body, "max_tokens", (int,), None, "an integer")
    mct = _get(body, "max_completion_tokens", (int,), None, "an integer")
    if max_tokens is None:
        max_tokens = mct
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens", code="invalid_value")
    temperature = float(_get(body, "temperature", (int, float), 1.0, "a number"))
    if not 0.0 <= temperature <= 2.0:
        raise bad(f"'temperature' must be between 0 and 2, got {temperature}", param="temperature", code="invalid_value")
    top_p = float(_get(body, "top_p", (int, float), 1.0, "a number"))
    if not 0.0 < top_p <= 1.0:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = _get(body, "top_k", (int,), 0, "an integer")
    if top_k < 0 and top_k != -1:
        raise bad(f"'top_k' must be >= 0 (or -1 for none), got {top_k}", param="top_k", code="invalid_value")
    seed = _get(body, "seed", (int,), None, "an integer")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad("'seed' must fit in 64 bits", param="seed", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop", code="invalid_value")
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", param="stop", code="invalid_value")
    n = _get(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise bad("only n=1 is supported", param="n", code="invalid_value")
    for name in ("logprobs", "top_logprobs", "logit_bias", "best_of", "suffix", "response_format"):
        v = body.get(name)
        if v not in (None, False, {}, 1 if name == "best_of" else None):
            if not (name == "response_format" and isinstance(v, dict) and v.get("type") == "text"):
                raise bad(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _get(body, name, (int, float), 0.0, "a number")
        if v != 0:
            raise bad(f"'{name}' is not supported by this server (only 0)", param=name, code="unsupported_parameter")
    ignore_eos = _get(body, "ignore_eos", (bool,), False, "a boolean")
    user = _get(body, "user", (str,), None, "a string")
    return dict(model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed, stop=stop,
                ignore_eos=ignore_eos, user=user)


def parse_completion(body: dict, served_names: set[str]) -> GenerationRequest:
    common = _common(body, served_names)
    if body.get("echo"):
        raise bad("'echo' is not supported by this server", param="echo", code="unsupported_parameter")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("you must provide a prompt", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]   # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' must not be empty", param="prompt", code="invalid_value")
        return GenerationRequest(prompt_text=p, **common)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return GenerationRequest(prompt_ids=list(p), **common)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad("batched prompts are not supported; send one request per prompt", param="prompt",
                  code="unsupported_parameter")
    raise bad("'prompt' must be a non-empty string or a non-empty array of token ids", param="prompt",
              code="invalid_type")


def parse_chat(body: dict, served_names: set[str]) -> GenerationRequest:
    common = _common(body, served_names)
    msgs = body.get("messages")
    if msgs is None:
        raise bad("you must provide 'messages'", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", param="messages", code="invalid_type")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role must be a string", param=f"messages[{i}].role", code="invalid_type")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {role!r}",
                      param=f"messages[{i}].role", code="invalid_value")
        c = m.get("content")
        if c is None and role != "assistant":
            raise bad(f"messages[{i}].content is required", param=f"messages[{i}].content",
                      code="missing_required_parameter")
        if c is not None and not isinstance(c, (str, list)):
            raise bad(f"messages[{i}].content must be a string or an array of content parts",
                      param=f"messages[{i}].content", code="invalid_type")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be an array of objects", param="tools", code="invalid_type")
    kw = _get(body, "chat_template_kwargs", (dict,), {}, "an object")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "max"):
            raise bad("'reasoning_effort' must be low, medium, high or max", param="reasoning_effort",
                      code="invalid_value")
        kw = {**kw, "reasoning_effort": effort}
    return GenerationRequest(messages=msgs, tools=tools or None, template_kwargs=kw, **common)
