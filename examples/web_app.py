"""A small web app with the engine inside it: type a prompt, watch the answer stream in, press Stop.

    python examples/web_app.py                    # the default model (SmolLM2-135M-Instruct, on CPU)
    python examples/web_app.py --model DIR --port 8080

One process: Starlette serves the page and runs AsyncLLMEngine in its lifespan; no separate model
server. The page POSTs the prompt to /generate and reads the answer as server-sent events with
fetch + ReadableStream. Stop aborts that fetch: the browser drops the connection, the server's
response task is cancelled, and cancelling the task that reads an engine stream aborts the request,
so its KV blocks are free before the engine's next step. GET /stats shows engine.stats().

GET /metrics is Prometheus text from the app's own registry: the engine's collectors
(asyncllm.server.EngineMetrics: engine state at scrape time, request latencies as requests end)
beside a metric of the app's own. If the engine dies mid-answer, the stream sends an error event
and the page shows it. Request bodies are read by the server's reader (asyncllm.server.read_json_body):
over 1 MiB is a 413, slower than 30 s a 408.
"""
from __future__ import annotations

import argparse
from contextlib import asynccontextmanager

import uvicorn
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from asyncllm import AsyncLLMEngine, EngineDeadError, QueueFullError, SamplingParams
from asyncllm.server import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, APIError, EngineMetrics, EventStreamResponse,
                             read_json_body, sse)

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asyncllm</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; }
  textarea { width: 100%; box-sizing: border-box; font: inherit; padding: .5rem; }
  .row { display: flex; gap: .5rem; align-items: center; margin: .5rem 0; }
  button { font: inherit; padding: .35rem 1rem; }
  #output { white-space: pre-wrap; border: 1px solid #ccc; border-radius: 6px; padding: .75rem;
            min-height: 8rem; background: #fafafa; }
  #status { color: #555; }
  #status[data-state=error] { color: #b00; }
</style>
</head>
<body>
<h1>asyncllm</h1>
<form id="form">
  <textarea id="prompt" rows="3" placeholder="Ask something" autofocus></textarea>
  <div class="row">
    <button id="send" type="submit">Send</button>
    <button id="stop" type="button" disabled>Stop</button>
    <label>max tokens <input id="max-tokens" type="number" min="1" value="__MAX_TOKENS__" style="width:6rem"></label>
    <span id="status" data-state="idle">ready</span>
  </div>
</form>
<div id="output"></div>
<script>
const $ = (id) => document.getElementById(id);
let controller = null;

function setStatus(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

async function generate(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || controller) return;
  controller = new AbortController();
  $("output").textContent = "";
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating", "generating…");
  let tokens = 0;
  try {
    const response = await fetch("/generate", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({prompt, max_tokens: Number($("max-tokens").value)}),
      signal: controller.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error || response.statusText);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!line.startsWith("data: ")) continue;
        const data = JSON.parse(line.slice(6));
        if (data.text) $("output").textContent += data.text;
        if (data.tokens) tokens = data.tokens;
        if (data.error) throw new Error(data.error);
        if (data.finish_reason) setStatus("done", `done (${data.finish_reason}, ${tokens} tokens)`);
      }
    }
    // a stream that ends without a finish_reason was cut off, not done
    if ($("status").dataset.state === "generating") throw new Error("the answer ended early");
  } catch (err) {
    if (err.name === "AbortError") setStatus("stopped", "stopped");
    else setStatus("error", "error: " + err.message);
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
</script>
</body>
</html>
"""


def create_app(model: str | None = None, *, max_tokens: int = 256, max_tokens_limit: int = 4096,
               ignore_eos: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, **engine_options) -> Starlette:
    engine = AsyncLLMEngine(model, **engine_options)
    # the app's own registry: the engine's metrics and the app's side by side on one /metrics
    registry = CollectorRegistry()
    metrics = EngineMetrics(engine, "web-app", registry=registry)
    page_views = Counter("web_app_page_views", "Times the page was served.", registry=registry)

    @asynccontextmanager
    async def lifespan(app):
        async with engine:  # started with the app, shut down with it
            yield

    async def page(request: Request) -> HTMLResponse:
        page_views.inc()
        return HTMLResponse(PAGE.replace("__MAX_TOKENS__", str(max_tokens)))

    async def generate(request: Request):
        try:
            # the server's reader: a body over max_body_bytes is a 413, one slower than body_timeout a 408
            body = await read_json_body(request, max_body_bytes, body_timeout)
            prompt = body["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("prompt: expected a non-empty string")
            wanted = body.get("max_tokens", max_tokens)
            if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
                raise ValueError(f"max_tokens: expected an integer >= 1, got {wanted!r}")
            params = SamplingParams(temperature=0.7, top_p=0.95, ignore_eos=ignore_eos,
                                    max_tokens=min(wanted, max_tokens_limit))
            stream = engine.chat([{"role": "user", "content": prompt}], params)
        except QueueFullError as e:
            metrics.observe_rejection(429)
            return JSONResponse({"error": str(e)}, status_code=429, headers={"Retry-After": "1"})
        except EngineDeadError as e:
            metrics.observe_rejection(503)
            return JSONResponse({"error": str(e)}, status_code=503)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers or None)
        except (ValueError, TypeError, KeyError) as e:
            return JSONResponse({"error": f"bad request: {e}"}, status_code=400)

        ending = {"failed": False, "recorded": False}

        async def events():
            # When the browser goes away (Stop aborts the fetch), this generator is cancelled or
            # closed; leaving `async with stream` then aborts the request in the engine.
            async with stream:
                yield sse({"id": stream.request_id})
                try:
                    async for out in stream:
                        if out.text:
                            yield sse({"text": out.text})
                        if out.finish_reason:
                            yield sse({"finish_reason": out.finish_reason, "tokens": len(stream.token_ids)})
                except EngineDeadError as e:  # the page must say so, not "done"
                    ending["failed"] = True
                    yield sse({"error": f"the engine failed: {e}"})

        async def close() -> None:
            # also covers a browser gone before the body started (the generator never ran)
            await stream.aclose()
            if not ending["recorded"]:
                ending["recorded"] = True
                metrics.observe_request(stream, "error" if ending["failed"] else stream.finish_reason or "abort")

        return EventStreamResponse(events(), on_close=close, keepalive_interval=10.0)

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(engine.stats())

    async def metrics_page(request: Request) -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    app = Starlette(routes=[Route("/", page), Route("/generate", generate, methods=["POST"]),
                            Route("/stats", stats), Route("/metrics", metrics_page)], lifespan=lifespan)
    app.state.engine = engine
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=256, help="the page's default answer length")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max tokens (for demos and tests)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kvcache-blocks", type=int, default=-1)
    args = parser.parse_args()
    app = create_app(args.model, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                     max_model_len=args.max_model_len, num_kvcache_blocks=args.num_kvcache_blocks)
    print(f"open http://{args.host}:{args.port}/ (loading the model first)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)


if __name__ == "__main__":
    main()
