"""One front-end process of `asyncllm serve --api-server-count N`: create_app's routes on an
EngineClient, served by uvicorn (the same DrainingServer and protocol as the single-process
server) on the listening socket that the engine process made and shares with the other front-ends."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from asyncllm.config import Config


@dataclass
class FrontendSettings:
    """What a front-end is started with (pickled to it by multiprocessing's spawn)."""
    config: Config  # the engine's: the model (its tokenizer, vocabulary, EOS ids, reasoning parser)
    model_name: str
    api_key: str | None
    parse_special_tokens_in_chat_content: bool
    app_options: dict = field(default_factory=dict)  # create_app's: the limits, keep-alive, templates
    log_level: str = "info"
    timeout_keep_alive: float = 5.0
    limit_concurrency: int | None = None
    drain_s: float = 5.0


def run_frontend(sock: socket.socket, engine_path: str, settings: FrontendSettings) -> None:
    """The front-end process's body; exits 0 after a shutdown (SIGTERM), 1 if the engine went away."""
    os.setpgrp()  # a terminal's Ctrl-C goes to the engine process, which stops the front-ends in order
    import functools

    import uvicorn

    from asyncllm.engine.intake import RequestIntake
    from asyncllm.models.tokenizer_loader import load_tokenizer
    from asyncllm.server.app import create_app
    from asyncllm.server.connections import DrainingServer, http_protocol
    from asyncllm.server.engine_client import EngineClient

    logging.basicConfig(level=settings.log_level.upper(), format=f"%(levelname)s:     [front-end {os.getpid()}] "
                                                                 "%(message)s")
    config = settings.config
    # the intake takes the engine's max_seq_len, known once the engine is ready
    make_intake = functools.partial(RequestIntake, config, load_tokenizer(config.model))
    client = EngineClient(engine_path, make_intake, settings.parse_special_tokens_in_chat_content)
    # the lifespan's start waits for the engine's readiness; meanwhile /health says "starting"
    app = create_app(client, settings.model_name, settings.api_key, manage_engine=True, start_in_background=True,
                     lifecycle=client.lifecycle, **settings.app_options)
    uvicorn_config = uvicorn.Config(app, log_level=settings.log_level, http=http_protocol(),
                                    timeout_keep_alive=settings.timeout_keep_alive,
                                    limit_concurrency=settings.limit_concurrency)
    server = DrainingServer(uvicorn_config, app.state.server.drain, settings.drain_s)
    lost = []

    def engine_lost() -> None:
        lost.append(True)
        server.should_exit = True
    client.on_lost = engine_lost

    def stopped(signum, frame) -> None:
        # uvicorn raises the signal it shut down on again once done: the engine process's SIGTERM is
        # the ordinary way out
        sys.exit(1 if lost else 0)
    signal.signal(signal.SIGTERM, stopped)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    sys.exit(1 if lost or not server.started else 0)
