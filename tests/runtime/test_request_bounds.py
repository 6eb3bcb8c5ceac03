"""What one request may cost the batch scheduler: memory sized by the context, never by the
request's token budget, and numbers out of range refused at ``submit`` (issue 24)."""

from __future__ import annotations



from lyanna_train.runtime.scheduling.requests import Status
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape

from .conftest import LAYER_IDS


def _decoder(target):
    plain = DecodeSettings(TreeShape(0, 1, 1, 0), LookupSettings(0, pool_tokens=0))
    return BatchDecoder(target, None, plain, max_batch=2, eos_ids=(), layer_ids=LAYER_IDS)


def test_a_budget_past_the_machines_memory_decodes_to_the_context_in_bounded_memory(tiny_target):
    """``max_new_tokens`` 10**15 (8 PB of token ids, allocated at admission before): the row is
    sized by the 512-position context and stops at its end."""
    decoder = _decoder(tiny_target)
    context = tiny_target.config.max_position_embeddings
    prompt = [1, 5, 6, 7]
    request = decoder.submit(prompt, 10**15)
    decoder.step()  # admission: where the buffer was torch.zeros(len(prompt) + max_new_tokens + 64)
    assert request.status is Status.RUNNING
    assert decoder.rows[0].context.numel() <= context + 64
    decoder.cancel(request)


def test_numbers_out_of_range_fail_the_request_alone(tiny_target):
    decoder = _decoder(tiny_target)
    seed = decoder.submit([1, 2, 3], 4, seed=2**80)  # torch's generator took it at admission: an OverflowError
    flag = decoder.submit([1, 2, 3], True)
    fraction = decoder.submit([1, 2, 3], 2.5)
    huge_id = decoder.submit([1, 10**30], 4)  # past int64: torch.as_tensor raised from submit
    good = decoder.submit([1, 2, 3], 3)
    assert seed.status is Status.FAILED and "seed must be an integer in" in seed.error
    assert flag.status is Status.FAILED and "max_new_tokens must be an integer" in flag.error
    assert fraction.status is Status.FAILED and "max_new_tokens" in fraction.error
    assert huge_id.status is Status.FAILED and "prompt ids must be integers" in huge_id.error
    for _ in decoder.run():
        pass
    assert good.status is Status.FINISHED and len(good.tokens) == 3
