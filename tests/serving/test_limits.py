"""What a client can make the server hold (issue 24): every number is checked before anything
is allocated (a 400), bodies are bounded (413), requests in flight and waiting are bounded
(429), and a port in use is one line before the models load."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from .conftest import MODEL, start_server


def _post(server, body: dict, path: str = "completions") -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=60)


@pytest.mark.parametrize("field, value, param, code", [
    ("max_tokens", 10**15, "max_tokens", "context_length_exceeded"),  # 8 PB of ids at admission, before
    ("max_tokens", 10**30, "max_tokens", "context_length_exceeded"),  # a torch C++ trace in a 500, before
    ("max_tokens", 600, "max_tokens", "context_length_exceeded"),  # past the 512-position context
    ("max_tokens", True, "max_tokens", "invalid_value"),
    ("seed", 2**80, "seed", "invalid_value"),  # "Overflow when unpacking long long" in a 500, before
    ("n", 10**30, "n", "invalid_value"),
    ("best_of", 10**30, "best_of", "invalid_value"),
])
def test_a_number_out_of_range_is_a_400_before_anything_is_allocated(server, tiny, field, value, param, code):
    began = time.perf_counter()
    response = _post(server, {"model": MODEL, "prompt": "hi", field: value, "stream": True})
    took = time.perf_counter() - began
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert took < 2.0 and server.engine.live_requests == 0  # refused on the HTTP side: nothing reached the engine
    if code == "context_length_exceeded":
        n = len(tiny.tokenizer("hi")["input_ids"])
        assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you "
                                           f"requested {value + n} tokens ({n} in the prompt, {value} in the completion)")


def test_the_budget_fits_the_context_exactly_and_the_default_is_cut_to_it(server, tiny):
    prompt = tiny.tokenizer("hi")["input_ids"]
    room = 512 - len(prompt)
    assert _post(server, {"model": MODEL, "prompt": "hi", "max_tokens": room + 1}).status_code == 400
    ok = _post(server, {"model": MODEL, "prompt": [5] * 506, "temperature": 0})  # no max_tokens: default 16, room 6
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    chat = _post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens":
                          10**9}, "chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


@pytest.fixture
def limited(tiny):
    """A server with one decoding slot, one waiting place, two requests in flight, 4 KiB bodies,
    and steps of >= 20 ms (a request of 80 tokens stays in flight >= 1.6 s)."""
    from lyanna_train.runtime.settings import load_decode_settings
    from lyanna_train.serving.limits import Limits
    from lyanna_train.serving.server import build_app, target_only

    app = build_app(tiny.target, tiny.tokenizer, None, target_only(load_decode_settings("default")), MODEL,
                    max_batch=1, limits=Limits(max_concurrency=3, max_queue=1, max_body_bytes=4096))
    step = app.state.engine.decoder.step
    app.state.engine.decoder.step = lambda: (time.sleep(0.02), step())[1]
    running = start_server(app)
    yield running
    running.stop()


def _in_background(server, n: int) -> list[threading.Thread]:
    def long():
        try:
            _post(server, {"model": MODEL, "prompt": "tea", "max_tokens": 80, "temperature": 0})
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=long, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
        deadline = time.monotonic() + 30
        while server.engine.live_requests < threads.index(t) + 1:  # one at a time: a fixed order
            assert time.monotonic() < deadline
            time.sleep(0.01)
    return threads


@pytest.mark.slow
def test_past_the_queue_a_request_gets_a_429_with_retry_after(limited):
    import openai

    threads = _in_background(limited, 2)  # one decoding, one waiting: the queue is full
    response = _post(limited, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded" and "--max-queue" in response.text
    with openai.OpenAI(base_url=limited.base_url, api_key="none", max_retries=0) as client:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    for t in threads:
        t.join(60)
    assert _post(limited, {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200  # room again


@pytest.mark.slow
def test_past_max_concurrency_a_request_gets_a_429(limited):
    threads = _in_background(limited, 2)
    with socket.create_connection(("127.0.0.1", int(limited.url.rsplit(":", 1)[1]))) as held:
        # a third request in flight: headers sent, body never finished
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{")
        time.sleep(0.3)
        response = _post(limited, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 429 and "--max-concurrency" in response.text
    for t in threads:
        t.join(60)


def test_a_body_past_the_limit_is_a_413_whether_its_length_is_given_or_not(limited):
    big = {"model": MODEL, "prompt": "tea " * 2000}
    response = _post(limited, big)
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(10):
            yield b"tea " * 200
        yield b'"}'

    response = httpx.post(f"{limited.base_url}/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413 and "--max-body-bytes" in response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert limited.engine.live_requests == 0
    assert _post(limited, {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_lyanna_serve_on_a_port_in_use_is_one_line_before_the_models_load(tiny, capsys):
    from lyanna_train.cli.serve import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        began = time.perf_counter()
        assert main(["--draft", str(tiny.export), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"lyanna-serve: error: cannot listen on 127.0.0.1:{port}: Address already in "
                                        "use (is another server there? choose another --port)")
    assert time.perf_counter() - began < 5  # the target and the draft were never loaded
