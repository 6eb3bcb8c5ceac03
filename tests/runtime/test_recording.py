"""Features recorded while decoding equal a teacher-forced forward over the same tokens:
prompt positions from the prefill, answer positions from the verify forwards (accepted
nodes only), the last token from its own forward — with speculation on and off, greedy
and sampled, one row and several."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.data.features import FeatureExtractor
from lyanna_train.runtime.scheduling import batch
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.verification.recording import unclosed
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, SamplingParams, TreeShape

from .conftest import FIT_PROMPTS, LAYER_IDS, drafted_tokens

MAX_NEW = [40, 1, 25, 33]  # one request ends at its first token: its last position needs the extra forward
PLAIN = DecodeSettings(TreeShape(0, 1, 1, 0), LookupSettings(0, pool_tokens=0), verify="all")
SPECULATE = DecodeSettings(TreeShape(4, 2, 2, 8), LookupSettings(4, pool_tokens=4), verify="all")


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("mode", ["plain", "speculate", "speculate-sampled"])
@pytest.mark.slow
def test_recorded_features_equal_a_teacher_forced_forward(tiny_target, tiny_fitted, mode, max_batch, monkeypatch):
    # rows admitted together are prefilled in one padded forward (prompts of 1 to 16 tokens)
    monkeypatch.setattr(batch, "PREFILL_PADDING", 100.0)
    draft = None if mode == "plain" else tiny_fitted[True]
    settings = PLAIN if mode == "plain" else SPECULATE
    decoder = BatchDecoder(tiny_target, draft, settings, max_batch, eos_ids=(), layer_ids=LAYER_IDS,
                           record_features=True)
    sampling = SamplingParams(temperature=0.8) if mode.endswith("sampled") else None
    # closing tokens after the answer (a chat template's end of turn): recorded too, from the same chain forward
    closing = [(), (7, 3), (11,), ()]
    requests = [decoder.submit(p, n, sampling, seed=i, closing=c)
                for i, (p, n, c) in enumerate(zip(FIT_PROMPTS, MAX_NEW, closing))]
    for _ in decoder.run():
        pass
    if mode == "speculate" and max_batch == 1:
        assert sum(drafted_tokens(r) for r in requests) > 20  # multi-token paths were recorded
    extractor = FeatureExtractor(tiny_target, LAYER_IDS)
    for request in requests:
        ids = torch.tensor([request.prompt + request.tokens + unclosed(request.tokens, request.closing)])
        assert request.features.ids == ids[0].tolist()
        reference = extractor(ids)
        logits = tiny_target(ids).logits[0].float()
        got = request.features
        assert len(got) == ids.shape[1]
        torch.testing.assert_close(got.aux, reference.aux[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got.last, reference.last[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got.logsumexp, torch.logsumexp(logits, -1), atol=2e-4, rtol=1e-5)
        assert torch.equal(got.top1, logits.argmax(-1))


def test_unclosed_leaves_out_what_the_answer_already_ends_with():
    assert unclosed([5, 6, 7], (7, 3)) == [3]
    assert unclosed([5, 6], (7, 3)) == [7, 3]
    assert unclosed([5, 7, 3], (7, 3)) == []
    assert unclosed([], (7, 3)) == [7, 3]
    assert unclosed([5, 6], ()) == []


def test_nothing_is_recorded_unless_asked(tiny_target):
    decoder = BatchDecoder(tiny_target, None, PLAIN, 2, eos_ids=())
    request = decoder.submit(FIT_PROMPTS[0], 5)
    for _ in decoder.run():
        pass
    assert request.features is None and decoder.batch.recorder is None


def test_the_last_positions_are_scored_inside_the_batch_forwards(tiny_target):
    """An answer's last token and its closing tokens are scored in the batch's own verify
    forwards (the row rides along, its next closing token forced), never in a forward of
    their own: four rows ending together close together, every forward after the prefills
    spans all four."""
    decoder = BatchDecoder(tiny_target, None, PLAIN, 4, eos_ids=(), layer_ids=LAYER_IDS, record_features=True)
    requests = [decoder.submit(p, 6, closing=(7, 3)) for p in FIT_PROMPTS]
    spans = []
    handle = tiny_target.register_forward_pre_hook(lambda *_: spans.append(decoder.batch.cache.plan.rows))
    try:
        for _ in decoder.run():
            pass
    finally:
        handle.remove()
    assert spans[:4] == [slice(i, i + 1) for i in range(4)]  # the prefills
    assert spans[4:] and all(s == slice(0, 4) for s in spans[4:])
    assert len(spans) == 4 + 5 + 3  # 5 iterations to 6 tokens, then the last token and the two closing ones
    for request in requests:
        assert request.features.ids == request.prompt + request.tokens + [7, 3]
        assert request.finish_reason == "length"
