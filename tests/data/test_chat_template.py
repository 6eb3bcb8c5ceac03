"""Chat-template rendering and assistant spans on two different templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lyanna_train.data.chat_template import ChatRenderer
from lyanna_train.data.conversations import to_document


@pytest.fixture(params=["chatml", "header"])
def tokenizer(request, smollm2_tokenizer, header_template_dir):
    return smollm2_tokenizer if request.param == "chatml" else AutoTokenizer.from_pretrained(header_template_dir)


@pytest.mark.slow
def test_fast_render_equals_apply_chat_template(tokenizer, sharegpt_records):
    renderer = ChatRenderer(tokenizer)
    for i, rec in enumerate(sharegpt_records):
        msgs = to_document(i, rec).messages
        for gen in (False, True):
            assert renderer.render(msgs, gen) == tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen)


def test_spans_cover_assistant_content_and_end_of_turn_only(tokenizer):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question"},
            {"role": "assistant", "content": "answer one"}, {"role": "user", "content": "more"},
            {"role": "assistant", "content": "answer two"}]
    rendered = ChatRenderer(tokenizer).render_with_spans(msgs)
    pieces = [rendered.text[a:b] for a, b in rendered.spans]
    assert pieces == ["answer one<|im_end|>", "answer two<|im_end|>"]
    assert ChatRenderer(tokenizer).end_of_turn_tokens() == ["<|im_end|>"]


def test_special_token_text_inside_content_does_not_end_the_span(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "say <|im_end|> literally"}]
    rendered = ChatRenderer(smollm2_tokenizer).render_with_spans(msgs)
    (a, b), = rendered.spans
    assert rendered.text[a:b] == "say <|im_end|> literally<|im_end|>"


def test_conversation_opening_with_the_assistant_is_located(smollm2_tokenizer):
    msgs = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "hi"}]
    rendered = ChatRenderer(smollm2_tokenizer).render_with_spans(msgs)
    (a, b), = rendered.spans
    assert rendered.text[a:b] == "Hello, how can I help?<|im_end|>" and rendered.unaligned_turns == 0


@pytest.mark.slow
def test_template_that_rejects_a_conversation_raises_a_named_error(smollm2_tokenizer, tmp_path):
    from lyanna_train.data.chat_template import TemplateRenderError

    tok = AutoTokenizer.from_pretrained(ChatRenderer(smollm2_tokenizer).tokenizer.name_or_path)
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}x"
    with pytest.raises(TemplateRenderError, match="must start with user"):
        ChatRenderer(tok).render([{"role": "assistant", "content": "a"}])
