"""End to end: a real server process on loopback, the tiny model, the official `openai` client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_health_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("megastep_queue_depth", "megastep_running_sequences", "megastep_state_pool_tokens_used",
                 "megastep_step_seconds_bucket", "megastep_tokens_per_second"):
        assert name in text
    assert "state pool:" in server.output() and "sequences of" in server.output()


def test_openai_completions_stream_and_not(server):
    c = client(server)
    r = c.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == (10 if r.choices[0].finish_reason == "length"
                                                                        else r.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=10,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all("\ufffd" not in ch.choices[0].text for ch in chunks if ch.choices) or "\ufffd" in text


def test_openai_chat_stream_and_not(server):
    c = client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi 👋"}]
    r = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    stream = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == r.choices[0].message.content
    assert finish == r.choices[0].finish_reason and usage.completion_tokens == r.usage.completion_tokens


def _greedy_body(server, i: int) -> dict:
    return {"model": server.model, "prompt": f"Request {i}: tell me about number {i * 7}", "max_tokens": 8,
            "temperature": 0, "stream": True}


async def _stream_text(ac: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    text, finish = [], None
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                assert "error" not in ch, ch
                text.append(ch["choices"][0]["text"])
                finish = ch["choices"][0]["finish_reason"] or finish
    return "".join(text), finish


def test_32_concurrent_greedy_streams_equal_alone(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
            alone = [await _stream_text(ac, _greedy_body(server, i)) for i in range(32)]
            together = await asyncio.gather(*(_stream_text(ac, _greedy_body(server, i)) for i in range(32)))
            return alone, list(together)

    alone, together = asyncio.run(main())
    assert together == alone
    assert len({t for t, _ in alone}) > 1
    m = server.wait_idle()
    assert m["megastep_state_pool_tokens_used"] == 0 and m["megastep_engine_live_sequences"] == 0


def test_seeded_sampling_repeats(server):
    c = client(server)

    def sample(seed: int) -> str:
        return c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                    top_p=0.9, seed=seed, extra_body={"ignore_eos": True, "top_k": 50}).choices[0].text

    a, b = sample(1234), sample(1234)
    assert a == b
    assert {sample(1), sample(2)} != {a}


def test_stop_string_cuts_the_text(server):
    c = client(server)
    base = c.completions.create(model=server.model, prompt="Stop test", max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:6]
    r = c.completions.create(model=server.model, prompt="Stop test", max_tokens=16, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_disconnect_mid_stream_frees_state(server):
    before = server.metrics().get('megastep_requests_finished_total{reason="cancelled"}', 0)
    body = {"model": server.model, "prompt": "Go on forever", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as hc:
        with hc.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
    assert server.metrics()["megastep_running_sequences"] >= 0
    m = server.wait_idle(30)
    assert m["megastep_running_sequences"] == 0
    assert m["megastep_state_pool_tokens_used"] == 0 and m["megastep_engine_live_sequences"] == 0
    assert m['megastep_requests_finished_total{reason="cancelled"}'] == before + 1


BAD = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "x"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": "$M"}, 400, "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "$M"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": "$M", "prompt": 42}, 400, "invalid_type"),
    ("/v1/completions", {"model": 7, "prompt": "x"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "max_tokens": "5"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "max_tokens": 2.5}, 400, "invalid_type"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "stream": "yes"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "temperature": "hot"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "stop": 5}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "$M", "messages": "hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "$M", "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "$M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "$M", "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "max_tokens": 10**9}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "temperature": -0.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "temperature": 2.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "top_p": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": [1, 2, 999999999]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "word " * 5000}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "$M", "messages": [{"role": "user", "content": "word " * 5000}]},
     400, "context_length_exceeded"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "n": 3}, 400, "invalid_value"),
    ("/v1/completions", {"model": "$M", "prompt": "x", "logprobs": 5}, 400, "unsupported_parameter"),
]


@pytest.mark.parametrize("path,body,status,code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(server, path, body, status, code):
    if isinstance(body, dict):
        raw = json.dumps(body).replace('"$M"', json.dumps(server.model)).encode()
    else:
        raw = body
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]


def test_server_survives_bad_input_and_still_serves(server):
    r = client(server).completions.create(model=server.model, prompt="still alive?", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model=server.model, prompt="x", max_tokens=-5)
    assert httpx.get(server.url + "/v1/nothing-here").status_code == 404
    assert httpx.get(server.url + "/v1/completions").status_code == 405


def test_waits_for_room_and_429_over_the_queue_limit(small_server):
    s = small_server
    long_body = {"model": s.model, "prompt": "fill the pool", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    short_body = {"model": s.model, "prompt": "small one", "max_tokens": 100, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as ac:
            first = asyncio.create_task(ac.post("/v1/completions", json=long_body))   # ~208 of 256 pool tokens
            while s.metrics()["megastep_running_sequences"] < 1:
                await asyncio.sleep(0.05)
            second = asyncio.create_task(ac.post("/v1/completions", json=short_body))  # cannot fit now: waits
            while s.metrics()["megastep_queue_depth"] < 1:
                await asyncio.sleep(0.05)
            m = s.metrics()
            assert m["megastep_running_sequences"] == 1 and m["megastep_state_pool_tokens_used"] >= 200
            third = await ac.post("/v1/completions", json=short_body)                 # queue full: 429
            r1, r2 = await first, await second
            return r1, r2, third

    r1, r2, third = asyncio.run(main())
    assert third.status_code == 429
    assert int(third.headers["retry-after"]) >= 1
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert r1.status_code == 200 and r1.json()["usage"]["completion_tokens"] == 200
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 100
    m = s.wait_idle()
    assert m["megastep_state_pool_tokens_used"] == 0 and m["megastep_engine_live_sequences"] == 0


def test_thinking_chat_splits_reasoning(server):
    from megastep.server.chat import encode_dsv4

    msgs = [{"role": "user", "content": "Think about 2+2"}]
    c = client(server)
    r = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, temperature=0,
                                  extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message.model_dump()
    # the same prompt through /v1/completions gives the unsplit text
    raw = c.completions.create(model=server.model, prompt=encode_dsv4(msgs, thinking=True), max_tokens=10,
                               temperature=0).choices[0].text
    if "</think>" in raw:
        assert raw == m["reasoning_content"] + "</think>" + m["content"]
    else:
        assert m["reasoning_content"] == raw and m["content"] == ""
    stream = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    deltas = [ch.choices[0].delta.model_dump() for ch in stream if ch.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]
