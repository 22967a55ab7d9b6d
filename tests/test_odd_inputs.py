"""Every sampling field with every odd value, through the async engine and through the server.

For each (field, value) pair of ODD_VALUES x SAMPLING_FIELDS: SamplingParams either accepts it or
raises ValueError/TypeError naming `SamplingParams.<field>`, nothing else; an accepted one is run
through a live AsyncLLMEngine while a reference stream decodes, and the engine never dies; the same
value sent as JSON to the server gets 200 or an OpenAI-shaped 400, never a 500. The counts are
printed (docs/RELIABILITY.md quotes them): zero engine deaths, hangs or 500s is the outcome.
"""
from __future__ import annotations

import json
import math

import anyio
import pytest

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "max_tokens", "ignore_eos", "stop_token_ids", "stop",
                   "include_stop_str_in_output", "seed"]
ODD_VALUES = [None, True, False, 0, 1, -1, 2, 0.5, -0.5, 1e-9, 1e300, -1e300, math.nan, math.inf, -math.inf,
              2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, 10 ** 400, -(10 ** 400), "", "0.7", "5", "stop",
              "\ud800", [], [None], [-1], [1.5], ["a", 3], [2 ** 70], ["x" * 5000], ["y"] * 200, {}, {"a": 1},
              (1, 2), b"bytes", object()]
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def build(field: str, value):
    """SamplingParams with field=value on short, cheap defaults; None when refused as it must be."""
    base = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    try:
        return SamplingParams(**{**base, field: value})
    except (ValueError, TypeError) as e:
        assert f"SamplingParams.{field}" in str(e), (field, value, e)
        assert len(str(e)) < 500, "a huge value must not be printed whole"
        return None


async def test_every_sampling_field_with_every_odd_value(tiny_qwen3):
    counts = {"tried": 0, "refused": 0, "ran": 0, "engine_deaths": 0}
    reference_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16) as engine:
            alone = await engine.generate(PROMPT, reference_params)
            reference = engine.stream(PROMPT, reference_params)  # decodes while the odd requests come
            await reference.__anext__()
            for field in SAMPLING_FIELDS:
                for value in ODD_VALUES:
                    counts["tried"] += 1
                    params = build(field, value)
                    if params is None:
                        counts["refused"] += 1
                        continue
                    try:
                        stream = engine.stream(PROMPT, params)
                    except (ValueError, TypeError):  # refused at submission: checked against the model (token ids)
                        counts["refused"] += 1
                        continue
                    try:
                        async for _ in stream:
                            break  # one item is enough: the step that made it took this request
                        await stream.aclose()
                        counts["ran"] += 1
                    except EngineDeadError:
                        counts["engine_deaths"] += 1
                        raise
            async for _ in reference:
                pass
            assert reference.token_ids == alone.token_ids and reference.finish_reason == "length"
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    print(f"\nodd sampling values through the engine: {counts}")
    assert counts["tried"] >= 400 and counts["engine_deaths"] == 0 and counts["ran"] > 0


async def test_every_sampling_field_with_every_odd_json_value_is_never_a_500(tiny_qwen3):
    httpx = pytest.importorskip("httpx")
    from asyncllm.server import create_app
    counts: dict[int, int] = {}
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16) as engine:
            app = create_app(engine, "tiny", manage_engine=False, max_tokens_limit=4)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                for field in SAMPLING_FIELDS + ["n", "logit_bias", "stream", "user"]:
                    for value in ODD_VALUES:
                        try:
                            body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0, field: value})
                        except (TypeError, ValueError):
                            continue  # not expressible as JSON
                        response = await client.post("/v1/completions", content=body,
                                                     headers={"content-type": "application/json"})
                        counts[response.status_code] = counts.get(response.status_code, 0) + 1
                        assert response.status_code in (200, 400), (field, value, response.status_code, response.text)
                        if response.status_code == 400:
                            error = response.json()["error"]
                            assert error["type"] == "invalid_request_error" and error["message"], error
                            assert error["param"] in (field, "max_tokens"), (field, value, error)
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    print(f"\nodd JSON values through the server, by HTTP status: {counts}")
    assert sum(counts.values()) >= 400 and 500 not in counts
