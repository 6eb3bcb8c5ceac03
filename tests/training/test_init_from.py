"""``lyanna-train draft.init_from=DIR``: fine-tuning a head imported from another toolkit keeps
its vocabulary map (or rebuilds it, carrying shared rows over) and refuses another target."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lyanna_train.errors import LyannaError
from lyanna_train.export.importer import import_head
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.training.loop import train

from ..export.test_import import write_source
from .conftest import compose, tiny_overrides

HOT = 64


pytestmark = pytest.mark.slow  # every test is a train() run

@pytest.fixture(scope="module")
def imported(tiny_target_dir, tmp_path_factory):
    """A speculators-layout head for the tiny target (its trainer's variants on), imported: (dir, head)."""
    from transformers import AutoConfig, LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    torch.manual_seed(5)
    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target_dir), HOT, aux_layer_ids=(0, 1, 2),
                                  pool_size=0, alpha_max=0.0, norm_before_fc=True, norm_output=True)
    head = DraftHead(cfg, torch.randperm(49152)[:HOT], target.get_input_embeddings().weight)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("init-from")
    src = write_source(root / "src", head, "speculators", embed=target.get_input_embeddings().weight)
    import_head(src, root / "imported", str(tiny_target_dir), say=lambda *_: None)
    return root / "imported", head


def _run(tmp_path, tiny_target_dir, tiny_corpus, imported_dir, *extra):
    out = tmp_path / "run"
    train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, f"draft.init_from={imported_dir}",
                                 "train.max_steps=1", "train.lr=1e-12", "eval.num_prompts=0",
                                 *extra)))
    return load_file(str(out / "checkpoints" / "step-00000001" / "model.safetensors")), out


def test_fine_tuning_an_imported_head_keeps_its_map_and_weights(tmp_path, tiny_target_dir, tiny_corpus, imported,
                                                                capsys):
    imported_dir, head = imported
    state, out = _run(tmp_path, tiny_target_dir, tiny_corpus, imported_dir)
    assert torch.equal(state["d2t"], head.d2t) and torch.equal(state["t2d"], head.t2d)
    for name in ("fc.weight", "input_norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"):
        torch.testing.assert_close(state[name], head.state_dict()[name], rtol=0, atol=1e-6)  # lr 1e-12: one step
    assert "vocabulary map kept (64 tokens" in capsys.readouterr().out
    assert not (out / "hotvocab").exists()  # the run built no map of its own
    import json

    draft_config = json.loads((out / "checkpoints" / "step-00000001" / "draft_config.json").read_text())
    assert draft_config["norm_before_fc"] and draft_config["norm_output"] and draft_config["aux_layer_ids"] == [0, 1, 2]


def test_rebuilding_the_map_carries_the_shared_rows_over(tmp_path, tiny_target_dir, tiny_corpus, imported, capsys):
    imported_dir, head = imported
    state, _ = _run(tmp_path, tiny_target_dir, tiny_corpus, imported_dir, "draft.init_vocab=rebuild",
                    f"hotvocab.size={HOT * 8}")
    new_hot = state["d2t"] + torch.arange(len(state["d2t"]))
    assert len(new_hot) == HOT * 8 and not torch.equal(new_hot[:HOT], head.hot_ids)
    old_row = {int(t): r for r, t in enumerate(head.hot_ids.tolist())}
    shared = [(i, old_row[int(t)]) for i, t in enumerate(new_hot.tolist()) if int(t) in old_row]
    assert shared  # the corpus' frequent tokens overlap the head's map
    for i, r in shared:
        torch.testing.assert_close(state["lm_head.weight"][i], head.lm_head.weight[r].detach(), rtol=0, atol=1e-6)
    assert f"{len(shared)} of {HOT * 8} LM head rows carried over" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (("target.aux_layers=[0,1,1]",), "target.aux_layers"),
    (("draft.intermediate_size=32",), "draft.intermediate_size=32"),
    (("draft.target_init.lm_head=true",), "alternatives"),
])
def test_settings_that_would_reshape_the_head_are_refused(tmp_path, tiny_target_dir, tiny_corpus, imported, extra,
                                                          message):
    with pytest.raises(LyannaError, match=message):
        _run(tmp_path, tiny_target_dir, tiny_corpus, imported[0], *extra)


def test_a_head_for_another_target_is_refused(tmp_path, tiny_corpus, tiny_target_dir, imported, smollm2_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(9)
    other = tmp_path / "other-target"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    with pytest.raises(LyannaError, match="another target"):
        _run(tmp_path, other, tiny_corpus, imported[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_carry_over_from_an_exported_head_on_the_gpu():
    """The exported head loads on the target's device (the GPU); the head to train is built on the host."""
    from lyanna_train.training.init_from import _carry_over

    cfg = DraftConfig(target_hidden_size=16, vocab_size=50, draft_vocab_size=10, hidden_size=16, intermediate_size=32,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, pool_size=0, alpha_max=0.0)
    torch.manual_seed(0)
    embed = torch.randn(50, 16)
    head = DraftHead(cfg, torch.arange(10), embed).cuda()
    new = DraftHead(cfg, torch.arange(5, 15), embed)
    assert _carry_over(new, head) == 5  # target ids 5..9: the head's rows 5..9 become the new rows 0..4
    torch.testing.assert_close(new.lm_head.weight[:5], head.lm_head.weight[5:].cpu())
    torch.testing.assert_close(new.fc.weight, head.fc.weight.cpu())
