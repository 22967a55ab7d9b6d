"""The client side of the serving benchmarks, without torch: a request's clock, the open- and
closed-loop driver, the HTTP clients (httpx reading server-sent events, and the official openai
package's async client), and the client process bench_http.py starts several of.

    python benchmarks/load_clients.py SPEC.json OUT.json

A client process reads its share of a workload from SPEC.json ({"base", "model", "client",
"requests": [[prompt token ids, max_tokens], ...], "offsets": [seconds] or null, "concurrency",
"temperature"}), makes its client, prints "ready", reads the start time (time.time()) from
stdin, runs, and writes {"results": [one dict per request], "end": time.time()} to OUT.json.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

Send = Callable[[list[int], int], Awaitable[dict]]


class ChunkClock:
    """One request's timing as its consumer sees it: tick() at each chunk that brings tokens.
    TTFT = start to the first chunk, ITL = every gap between chunks, TPOT = (E2E - TTFT) / (tokens - 1)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = self.last = None
        self.gaps: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def result(self, tokens: int) -> dict:
        e2e = time.perf_counter() - self.start
        ttft = None if self.first is None else self.first - self.start
        tpot = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
        return dict(ttft=ttft, itl=self.gaps, tpot=tpot, e2e=e2e, tokens=tokens)


async def drive(send: Send, requests: list[tuple[list[int], int]], offsets: list[float] | None,
                concurrency: int) -> list[dict]:
    """Each (prompt, max_tokens) through send. Open loop: request i starts offsets[i] seconds after
    the call (all zero: one burst). Closed loop (offsets None): `concurrency` clients, each taking
    the next request when its last one has finished. A request that fails gives {"error": ...}."""
    async def one(prompt, max_tokens) -> dict:
        try:
            return await send(prompt, max_tokens)
        except Exception as exc:  # noqa: BLE001 - one failed request is a counted error, not the end of the run
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    if offsets is not None:
        start = time.perf_counter()

        async def at(offset: float, request) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await one(*request)
        return list(await asyncio.gather(*(at(o, r) for o, r in zip(offsets, requests))))
    pending = iter(requests)
    results: list[dict] = []

    async def client() -> None:
        for request in pending:  # shared iterator: each client takes the next request when it is free
            results.append(await one(*request))
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def completion_body(model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    """A streamed /v1/completions request for token ids, EOS ignored, with the usage chunk (the token count)."""
    return dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})


def httpx_sender(client, base: str, model: str, temperature: float) -> Send:
    """Requests over an httpx.AsyncClient, reading the server-sent events line by line: a chunk
    whose choice has text is a tick; the usage chunk gives the token count."""
    url = f"{base}/v1/completions"

    async def send(prompt: list[int], max_tokens: int) -> dict:
        clock, tokens = ChunkClock(), 0
        async with client.stream("POST", url, json=completion_body(model, prompt, max_tokens, temperature)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ': keep-alive' comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    clock.tick()
        return clock.result(tokens)
    return send


def openai_sender(client, model: str, temperature: float) -> Send:
    """Requests through the openai package's AsyncOpenAI (completions.create, stream=True)."""
    async def send(prompt: list[int], max_tokens: int) -> dict:
        clock, tokens = ChunkClock(), 0
        body = completion_body(model, prompt, max_tokens, temperature)
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options=body["stream_options"], extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                clock.tick()
        return clock.result(tokens)
    return send


def make_client(kind: str, base: str, model: str, temperature: float):
    """(client, its sender): no connection limits or timeouts, which would throttle the load itself."""
    if kind == "httpx":
        import httpx  # optional packages, imported where used: a missing one fails only its own rows
        client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                     max_keepalive_connections=None))
        return client, httpx_sender(client, base, model, temperature)
    if kind == "openai":
        import openai
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=3600.0)
        return client, openai_sender(client, model, temperature)
    raise ValueError(f"client: expected 'httpx' or 'openai', got {kind!r}")


async def close_client(client) -> None:
    await (client.aclose() if hasattr(client, "aclose") else client.close())  # httpx's name, openai's


async def run_share(spec: dict) -> dict:
    client, send = make_client(spec["client"], spec["base"], spec["model"], spec["temperature"])
    requests = [(prompt, max_tokens) for prompt, max_tokens in spec["requests"]]
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    await asyncio.sleep(max(0.0, start_at - time.time()))
    results = await drive(send, requests, spec["offsets"], spec["concurrency"])
    end = time.time()
    await close_client(client)
    return {"results": results, "end": end}


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    out = asyncio.run(run_share(spec))
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1:])
