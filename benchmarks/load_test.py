"""Short loopback load test of a megastep server: requests/s and latency percentiles.

    python benchmarks/load_test.py --launch -- --max-seqs 8          # start a server, test it, stop it
    python benchmarks/load_test.py --url http://127.0.0.1:8000       # test a running server

Sends `--requests` completion requests (greedy, fixed max_tokens, ignore_eos so every request does
the same work) from `--concurrency` concurrent clients, streaming or not, and reports requests/s,
generated tokens/s, and p50/p90/p99 of end-to-end latency (and time to first token when
streaming). Loopback only, bounded in count and in time (`--time-limit`). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "In 1905 Einstein published",
           "The capital of France is", "A haiku about the sea:", "SELECT * FROM users WHERE", "Dear diary, today"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def one(client: httpx.AsyncClient, model: str, i: int, a) -> dict:
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": a.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": a.stream}
    t0 = time.perf_counter()
    ttft = None
    if a.stream:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None and line != "data: [DONE]":
                    if json.loads(line[6:]).get("choices", [{}])[0].get("text"):
                        ttft = time.perf_counter() - t0
        tokens = a.max_tokens
    else:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        tokens = r.json()["usage"]["completion_tokens"]
    return {"ok": True, "latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens}


async def run(a, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=a.time_limit) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one(client, model, 0, a)     # warm-up, not counted
        queue = list(range(a.requests))
        results: list[dict] = []
        deadline = time.perf_counter() + a.time_limit

        async def worker() -> None:
            while queue and time.perf_counter() < deadline:
                results.append(await one(client, model, queue.pop(), a))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    out = {"url": url, "model": model, "requests": len(results), "ok": len(ok),
           "errors": len(results) - len(ok), "concurrency": a.concurrency, "max_tokens": a.max_tokens,
           "stream": a.stream, "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3),
           "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
           "latency_p50_s": round(pct(lat, 50), 4), "latency_p90_s": round(pct(lat, 90), 4),
           "latency_p99_s": round(pct(lat, 99), 4)}
    if ttft:
        out.update(ttft_p50_s=round(pct(ttft, 50), 4), ttft_p99_s=round(pct(ttft, 99), 4))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (loopback); default: --launch one")
    ap.add_argument("--launch", action="store_true", help="start `python -m megastep.server` on a free port")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--time-limit", type=float, default=120.0, help="stop sending after this many seconds")
    ap.add_argument("server_args", nargs="*", help="after --: arguments for the launched server")
    a = ap.parse_args()
    proc = None
    url = a.url
    if url is None or a.launch:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "megastep.server", "--port", str(port), *a.server_args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                print(proc.stderr.read(), file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 180:
                proc.kill()
                print("server did not start in 180 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"refusing a non-loopback target {host}", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(run(a, url))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"{res['ok']}/{res['requests']} ok in {res['wall_s']} s, concurrency {a.concurrency}: "
          f"{res['requests_per_s']} req/s, {res['tokens_per_s']} tok/s, latency p50 {res['latency_p50_s']} s "
          f"p99 {res['latency_p99_s']} s", file=sys.stderr)
    print(json.dumps(res))
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
