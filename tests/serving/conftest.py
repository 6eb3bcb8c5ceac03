"""A live lyanna-serve on localhost (uvicorn in a thread) over the tiny random Llama and a
random draft exported for it; the tests talk to it with the real ``openai`` client."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ..tiny_models import byte_level_tokenizer, export_random_draft, tiny_llama

MODEL = "tiny-llama"


@pytest.fixture(scope="package")
def tiny(tmp_path_factory):
    """(tokenizer, target, draft loaded from its export, export dir), and a copy of the target
    and draft for reference decodings in the test thread (capture hooks and the draft's pool
    are per model: the server's decode thread owns the originals)."""
    import copy

    from lyanna_train.export.reader import load_exported

    tokenizer = byte_level_tokenizer()
    target = tiny_llama(tokenizer)
    export = export_random_draft(tmp_path_factory.mktemp("serve"), target, tokenizer)
    draft, _ = load_exported(export, target, tokenizer)
    reference = SimpleNamespace(target=copy.deepcopy(target))
    reference.draft, _ = load_exported(export, reference.target, tokenizer)
    return SimpleNamespace(tokenizer=tokenizer, target=target, draft=draft, export=export, reference=reference)


def start_server(app, server=None) -> SimpleNamespace:
    """Run ``app`` under uvicorn (``server``, default a plain one) on a free port in a daemon
    thread; ``stop()`` ends it."""
    import uvicorn

    server = server or uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(30)

    return SimpleNamespace(url=f"http://127.0.0.1:{port}", base_url=f"http://127.0.0.1:{port}/v1", app=app,
                           engine=app.state.engine, thread=thread, stop=stop)


def _serve(tiny, no_draft: bool):
    from lyanna_train.runtime.settings import load_decode_settings
    from lyanna_train.serving.server import build_app, target_only

    settings = load_decode_settings("default")
    if no_draft:
        settings = target_only(settings)
    torch.set_num_threads(1)  # tiny models: see tests/conftest.py one_thread (the decode thread inherits it)
    app = build_app(tiny.target, tiny.tokenizer, None if no_draft else tiny.draft, settings, MODEL, max_batch=4,
                    default_max_tokens=16)
    return start_server(app)


@pytest.fixture(scope="package")
def server(tiny):
    running = _serve(tiny, no_draft=False)
    yield running
    running.stop()


@pytest.fixture(scope="package")
def baseline_server(tiny):
    """The same, --no-draft: target-only decoding through the same engine."""
    running = _serve(tiny, no_draft=True)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120) as c:
        yield c
