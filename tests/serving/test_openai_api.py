"""lyanna-serve driven by the real ``openai`` client: chat and completions, streamed and whole,
greedy output equal to lyanna-generate's, continuous batching, stop strings, seeds, metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from lyanna_train.evaluation.prompts import render_prompt
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.settings import load_decode_settings

from .conftest import MODEL

PROMPTS = ["Write about tea.", "def fib(n):", "naïve café 🚀 東京"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "how are you today?"}, {"role": "user", "content": "The quick fox"}]


def reference(tiny, prompt_ids: list[int], max_tokens: int) -> str:
    """What lyanna-generate prints for these prompt ids: one prompt decoded alone."""
    result = generate(tiny.reference.target, tiny.reference.draft, prompt_ids, max_tokens,
                      load_decode_settings("default"))
    assert len(result.tokens) == max_tokens  # the tiny target has no EOS: every budget is used
    return tiny.tokenizer.decode(result.tokens, skip_special_tokens=True)


def chat_ids(tiny, messages) -> list[int]:
    return render_prompt(tiny.tokenizer, messages, chat=True)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.slow
def test_greedy_chat_equals_lyanna_generate(client, tiny, stream):
    for messages in [[{"role": "user", "content": p}] for p in PROMPTS] + [CONVERSATION]:
        ids = chat_ids(tiny, messages)
        want = reference(tiny, ids, 24)
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                         temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            final, usage = chunks[-1].choices[0].finish_reason, chunks[-1].usage
            assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        else:
            response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            assert response.object == "chat.completion" and response.model == MODEL
            assert response.choices[0].message.role == "assistant"
            text, final, usage = response.choices[0].message.content, response.choices[0].finish_reason, response.usage
        assert text == want
        assert final == "length"
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 24, len(ids) + 24)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.slow
def test_greedy_completion_equals_lyanna_generate_and_the_target(client, tiny, stream):
    import torch

    for prompt in PROMPTS:
        ids = tiny.tokenizer(prompt)["input_ids"]
        want = reference(tiny, ids, 20)
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                    stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            final, usage = chunks[-1].choices[0].finish_reason, chunks[-1].usage
        else:
            response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
            assert response.object == "text_completion"
            text, final, usage = response.choices[0].text, response.choices[0].finish_reason, response.usage
        assert text == want and final == "length" and usage.completion_tokens == 20 and usage.prompt_tokens == len(ids)
    with torch.inference_mode():  # and the target's own greedy decoding, for one prompt given as token ids
        ids = tiny.tokenizer(PROMPTS[1])["input_ids"]
        own = tiny.reference.target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):]
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert response.choices[0].text == tiny.tokenizer.decode(own, skip_special_tokens=True)


@pytest.mark.slow
def test_concurrent_requests_join_the_batch_and_each_equals_its_own_decoding(server, tiny):
    """Eight requests over four slots, different lengths: rows join and leave mid-run."""
    jobs = [(PROMPTS[i % 3] + " " * (i // 3), 6 + 5 * i) for i in range(8)]

    async def run_all():
        async with AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
                                          for p, n in jobs])

    results = asyncio.run(run_all())
    for (prompt, n), response in zip(jobs, results):
        assert response.choices[0].text == reference(tiny, tiny.tokenizer(prompt)["input_ids"], n)
        assert response.usage.completion_tokens == n


@pytest.mark.slow
def test_a_slow_reader_does_not_hold_up_other_requests(server, client, tiny):
    """A stream nobody reads while another request is served whole, then read: complete and correct."""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.base_url}/completions", json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": True}) as slow:
            fast = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0)
            assert fast.choices[0].text == reference(tiny, tiny.tokenizer(PROMPTS[1])["input_ids"], 30)
            lines = [line for line in slow.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        reference(tiny, tiny.tokenizer(PROMPTS[0])["input_ids"], 120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.slow
def test_stop_strings_end_the_text_before_them(client, tiny, stream):
    ids = tiny.tokenizer(PROMPTS[2])["input_ids"]
    want = reference(tiny, ids, 40)
    stop = next(want[i:i + 3] for i in range(6, len(want) - 3) if want[i:i + 3].strip() and "\ufffd" not in want[i:i + 3])
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                                stop=[stop, "never-appears"], stream=True))
        text, final = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=stop)
        text, final = response.choices[0].text, response.choices[0].finish_reason
    assert text == want[:want.index(stop)] and final == "stop"


@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible_alone_and_in_a_batch(server, client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=24, temperature=0.9,
                  top_p=0.95)
    alone = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content

    async def batch():
        async with AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[c.chat.completions.create(seed=s, **kwargs) for s in (7, 8, 9, 7)])

    texts = [r.choices[0].message.content for r in asyncio.run(batch())]
    assert texts[0] == texts[3] == alone
    assert len(set(texts)) > 1  # seeds 7, 8, 9 do not all sample the same 24 tokens


def test_no_draft_serves_the_same_greedy_text_one_token_per_forward(baseline_server, tiny):
    from prometheus_client.parser import text_string_to_metric_families

    with OpenAI(base_url=baseline_server.base_url, api_key="none", max_retries=0, timeout=120) as c:
        for prompt in PROMPTS[:2]:
            response = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            assert response.choices[0].text == reference(tiny, tiny.tokenizer(prompt)["input_ids"], 16)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{baseline_server.url}/metrics").text)}
    assert families["lyanna_mean_accepted_tokens"].samples[0].value == 1.0


def test_metrics_count_requests_tokens_tau_and_queue(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    with pytest.raises(Exception):
        client.completions.create(model="nope", prompt="x", max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("lyanna_requests_total", (("endpoint", "completions"), ("outcome", "length")))] >= 1
    assert samples[("lyanna_requests_total", (("endpoint", "completions"), ("outcome", "rejected")))] >= 1
    assert samples[("lyanna_generation_tokens_total", ())] >= 12
    assert samples[("lyanna_prompt_tokens_total", ())] > 0
    assert samples[("lyanna_mean_accepted_tokens", ())] >= 1.0
    assert samples[("lyanna_queue_length", ())] == 0 and samples[("lyanna_running_requests", ())] == 0
    assert ("lyanna_generation_tokens_per_second", ()) in samples
    assert samples[("lyanna_request_latency_seconds_count", ())] >= 1
