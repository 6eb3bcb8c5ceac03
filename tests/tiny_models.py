"""A tiny byte-level tokenizer, a tiny random Llama over it and a random draft exported for
it: what the CLI and server tests run end to end (instant forwards, real files on disk)."""

from __future__ import annotations

from pathlib import Path

import torch

H = 64
TEXTS = ["Hello there, how are you today?", "def add(a, b):\n    return a + b\n", "naïve café 🚀 東京 ok",
         "The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts and verifies tokens."]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer():
    """A byte-level BPE (multi-byte characters split over tokens) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    return fast


def tiny_llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.2: varied continuations and clear argmax margins (no fp ties).
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def export_random_draft(root: Path, target, tokenizer) -> Path:
    """The target + tokenizer saved under ``root/target`` and a random draft exported for it -> the export."""
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.models.config import DraftConfig
    from lyanna_train.models.draft_head import DraftHead
    from lyanna_train.training.checkpoint import write_draft_weights

    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    torch.manual_seed(1)
    cfg = DraftConfig(target_hidden_size=H, vocab_size=len(tokenizer), draft_vocab_size=48, hidden_size=H,
                      intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      aux_layer_ids=(0, 1, 2), pool_size=128, pool_threshold=0.0)
    draft = DraftHead(cfg, torch.randperm(len(tokenizer))[:48], target.model.embed_tokens.weight).eval()
    ckpt = root / "run" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    write_draft_weights(ckpt, draft, {"layer_ids": [0, 1, 2], "target": str(root / "target")})
    export_checkpoint(root / "run", root / "export", target=target, tokenizer=tokenizer, say=lambda *_: None)
    return root / "export"
