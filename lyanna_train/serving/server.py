"""Put the pieces together and run them under uvicorn, draining on SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops listening, so new connections are refused; requests
that reach the app on a connection still open get a 503; requests in flight run to their
end for at most ``shutdown_timeout`` seconds, after which uvicorn cancels them; then the
app's lifespan stops the decode thread and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from dataclasses import replace

import uvicorn

from ..runtime.settings import DecodeSettings, TreeShape
from ..runtime.scheduling.scheduler import BatchDecoder
from ..errors import LyannaError
from .app import ServedModel, create_app
from .decode_thread import Engine
from .limits import Limits
from .metrics import ServingMetrics


def target_only(settings: DecodeSettings) -> DecodeSettings:
    """The same decoding with nothing proposed: one token per target forward (``--no-draft``)."""
    return replace(settings, tree=TreeShape(depth=0, max_nodes=0),
                   lookup=replace(settings.lookup, max_tokens=0, pool_tokens=0))


def build_app(target, tokenizer, draft, settings: DecodeSettings, name: str, max_batch: int = 16, cost=None,
              default_max_tokens: int = 256, shutdown_timeout: float = 30.0, limits: Limits = Limits()):
    """The FastAPI app serving ``target`` (speculatively with ``draft``; None: as ``settings`` say
    without one) through a continuous-batching engine of ``max_batch`` slots, within ``limits``."""
    decoder = BatchDecoder(target, draft, settings, max_batch=max_batch, cost=cost)
    engine = Engine(decoder, ServingMetrics())
    model = ServedModel(name, tokenizer, getattr(target.config, "max_position_embeddings", None),
                        default_max_tokens, settings.sampling)
    return create_app(engine, model, shutdown_timeout, limits)


def listen(host: str, port: int) -> socket.socket:
    """The bound socket uvicorn will serve on, or one line saying why the address is not free:
    bound before the models load, so a port in use is refused at once (and never after
    "serving on ..." was printed)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as err:
        raise LyannaError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise LyannaError(f"cannot listen on {host}:{port}: {err.strerror or err} (is another server there? "
                          "choose another --port)") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app it is draining as soon as the signal arrives."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.draining = True
        super().handle_exit(sig, frame)


def serve(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Run until SIGTERM/SIGINT; returns after the drain. ``sock``: already bound (:func:`listen`)."""
    logging.getLogger("lyanna_train.serving").setLevel(log_level.upper())
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="on")
    # uvicorn raises the signal again once it has drained (so a parent sees it); with this
    # handler in place that is a no-op and a drained SIGTERM exits 0. Ctrl-C still ends as an interrupt.
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        DrainingServer(config).run(sockets=[sock] if sock is not None else None)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
