"""Bad input (a 400 with an OpenAI error body, and the server goes on), clients that go away
(their slot is freed), and shutdown (in-flight requests finish within a bound, new ones are
refused, the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from .conftest import MODEL, start_server

LONG = [5, 6, 7] * 200  # 600 token ids: past the tiny target's 512-position context


@pytest.mark.parametrize("case, body, param, code", [
    ("malformed JSON", b'{"model": "tiny-llama", "prompt": "hi",', None, "invalid_value"),
    ("not an object", b'[1, 2]', None, "invalid_value"),
    ("unknown model", {"model": "gpt-4o", "prompt": "hi"}, "model", "model_not_found"),
    ("negative max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, "max_tokens", "invalid_value"),
    ("prompt past the context", {"model": MODEL, "prompt": LONG}, "prompt", "context_length_exceeded"),
    ("token outside the vocabulary", {"model": MODEL, "prompt": [1, 99999]}, "prompt", None),
    ("n > 1", {"model": MODEL, "prompt": "hi", "n": 2}, "n", "invalid_value"),
    ("temperature out of range", {"model": MODEL, "prompt": "hi", "temperature": 7}, "temperature", "invalid_value"),
    ("two prompts", {"model": MODEL, "prompt": ["a", "b"]}, "prompt", None),
    ("echo", {"model": MODEL, "prompt": "hi", "echo": True}, "echo", "invalid_value"),
])
@pytest.mark.slow
def test_bad_completion_requests_get_a_400_and_the_server_goes_on(server, client, case, body, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.base_url}/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == code
    assert error["param"] == param
    if case == "malformed JSON":
        assert error["message"].startswith("malformed JSON body")
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3 and server.engine.live_requests == 0


def test_bad_chat_requests_raise_the_clients_own_errors(client):
    """What a user of the openai package sees: BadRequestError with the server's message."""
    long_message = [{"role": "user", "content": "tea " * 700}]
    for kwargs, words in [({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "does not exist"),
                          ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
                           "max_tokens"),
                          ({"model": MODEL, "messages": long_message}, "context"),
                          ({"model": MODEL, "messages": []}, "messages"),
                          ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "role")]:
        with pytest.raises(openai.BadRequestError, match=words) as caught:
            client.chat.completions.create(**kwargs)
        assert caught.value.status_code == 400
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).usage.completion_tokens == 2


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Every engine step takes >= 20 ms: a long request stays in flight for seconds."""
    decoder = server.engine.decoder
    step = decoder.step

    def slow():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(decoder, "step", slow)
    yield
    _wait_until_idle(server.engine)  # before the patch goes


def _wait_until_idle(engine, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while engine.live_requests or engine.decoder.rows:
        assert time.monotonic() < deadline, f"{engine.live_requests} requests still live"
        time.sleep(0.02)


def _count(server, outcome: str) -> float:
    return server.engine.metrics.requests.labels("completions", outcome)._value.get()


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "waiting-for-whole"])
@pytest.mark.slow
def test_a_client_that_goes_away_frees_its_slot(server, slow_steps, stream):
    cancelled = _count(server, "cancelled")
    body = {"model": MODEL, "prompt": "Write about tea.", "max_tokens": 480, "temperature": 0, "stream": stream}
    if stream:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert server.engine.live_requests == 1 and len(server.engine.decoder.rows) == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/completions", json=body, timeout=1.0)
    _wait_until_idle(server.engine, seconds=10)  # 480 tokens take far longer than this at >= 20 ms a step
    assert _count(server, "cancelled") == cancelled + 1
    assert _count(server, "length") >= 0 and not server.engine.decoder.waiting


@pytest.mark.slow
def test_drain_finishes_short_requests_cuts_long_ones_at_the_bound_and_refuses_new(tiny):
    """The DrainingServer's handle_exit (what SIGTERM calls), on a server in a thread."""
    import uvicorn

    from lyanna_train.runtime.settings import load_decode_settings
    from lyanna_train.serving.server import DrainingServer, build_app

    app = build_app(tiny.target, tiny.tokenizer, tiny.draft, load_decode_settings("default"), MODEL, max_batch=4,
                    shutdown_timeout=2.0)
    step = app.state.engine.decoder.step
    app.state.engine.decoder.step = lambda: (time.sleep(0.02), step())[1]
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on",
                                           timeout_graceful_shutdown=2.0))
    running = start_server(app, server)
    results: dict = {}

    def stream(name: str, max_tokens: int):
        body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{running.base_url}/completions", json=body, timeout=60) as response:
                results[name] = [line for line in response.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as err:  # cut at the bound
            results[name] = err

    threads = [threading.Thread(target=stream, args=("short", 12)), threading.Thread(target=stream, args=("long", 480))]
    for t in threads:
        t.start()
    while running.engine.live_requests < 2:
        time.sleep(0.01)
    began = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.draining
    running.thread.join(30)
    took = time.monotonic() - began
    for t in threads:
        t.join(30)
    assert not running.thread.is_alive() and took < 2.0 + 5  # the bound, plus the engine's stop
    short = [json.loads(line[6:]) for line in results["short"][:-1]]
    assert results["short"][-1] == "data: [DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
    assert short[-1]["usage"]["completion_tokens"] == 12
    long = results["long"]
    assert isinstance(long, Exception) or '"finish_reason": "length"' not in "".join(long)  # cut, not finished
    assert not running.engine.alive and running.engine.live_requests == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health", timeout=5)


def test_while_draining_new_requests_get_a_503_and_health_says_so(server, client):
    server.app.state.draining = True
    try:
        with pytest.raises(openai.InternalServerError, match="shutting down") as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "shutting_down"
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        server.app.state.draining = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish_refuses_new_ones_and_exits_0(tiny):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "lyanna_train.cli.serve", "--draft", str(tiny.export), "--port",
                             str(port), "--stock-linears", "--threads", "1", "--shutdown-timeout", "60",
                             "--served-model-name", MODEL, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "lyanna-serve did not come up"
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": "Write about tea.", "max_tokens": 300, "temperature": 0, "stream": True}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line)
                    break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:
                refused = httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=10).status_code
            except httpx.ConnectError:
                refused = "connection refused"
            chunks += [line for line in lines if line.startswith("data: ")]
        assert refused in (503, "connection refused")
        assert chunks[-1] == "data: [DONE]"
        last = json.loads(chunks[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv, words", [(["--draft", "/nonexistent/export"], "/nonexistent/export"),
                                         (["--draft", "x", "--max-batch", "0"], "--max-batch"),
                                         (["--draft", "x", "--port", "70000"], "--port")])
def test_lyanna_serve_bad_flags_are_one_line_and_exit_2(argv, words, capsys):
    from lyanna_train.cli.serve import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lyanna-serve: error:") and words in err[0]
