"""lyanna-plan on the Llama-2-7B and Llama-3-8B configs (written here: config.json only, no weights)."""

from __future__ import annotations

import json

import pytest

from lyanna_train.cli.plan import compose, main as plan_main
from lyanna_train.errors import LyannaError
from lyanna_train.training.plan import GiB, check_fits, make_plan

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
LLAMA3_8B = {**LLAMA2_7B, "intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


@pytest.fixture
def config_dir(tmp_path):
    def write(name: str, config: dict):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    return write


@pytest.mark.parametrize("recipe,config,params,hot", [
    ("llama2_7b", LLAMA2_7B, 6.74e9, 1600),
    ("llama3_8b", LLAMA3_8B, 8.03e9, 6413),
])
def test_plan_counts_the_real_models(recipe, config, params, hot, config_dir):
    cfg = compose([f"+recipe={recipe}", f"target.name={config_dir(recipe, config)}"])
    plan = make_plan(cfg, world=8)
    assert plan.target_params == pytest.approx(params, rel=0.005)  # the published sizes
    assert plan.hot_vocab == hot and plan.vocab == config["vocab_size"]
    # one EAGLE-3 layer shaped like the target's + fc (3H -> H) + the hot-vocabulary head + the α-gate
    h, i, heads, kv = 4096, config["intermediate_size"], 32, config["num_key_value_heads"]
    layer = 2 * h * heads * 128 + 2 * 2 * h * kv * 128 + h * heads * 128 + 3 * h * i + 3 * h
    assert plan.draft_params == pytest.approx(layer + 3 * h * h + hot * h + h, rel=0.01)
    assert plan.memory["target weights"] == plan.target_params * 2  # bf16, replicated
    assert plan.memory["optimizer state"] == pytest.approx(plan.draft_params * 12 / 8, rel=1e-6)  # ZeRO-2 over 8
    assert plan.bytes_per_token == 4 * 4096 * 2 + 13  # bf16 aux (3 layers) + last, ids, mask, teacher summary


def test_cli_prints_the_plan_and_refuses_what_does_not_fit(config_dir, capsys):
    target = config_dir("llama3", LLAMA3_8B)
    assert plan_main(["+recipe=llama3_8b", f"target.name={target}", "--gpus", "8", "--gpu-memory", "141",
                      "--tokens", "100000000"]) == 0
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out and "hot vocabulary 6,413" in out and "fits:" in out
    assert "32,781 bytes per token x 100,000,000 tokens" in out
    # ZeRO-0 on one 16 GiB GPU: the bf16 target alone is 15 GiB
    assert plan_main(["+recipe=llama3_8b", f"target.name={target}", "deepspeed.zero_stage=0", "--gpu-memory", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lyanna-plan: error: the plan needs" in err[0] and "more than the 16.0 GiB" in err[0]


def test_plan_follows_the_config(config_dir):
    target = config_dir("llama2", LLAMA2_7B)
    base = make_plan(compose(["+recipe=llama2_7b", f"target.name={target}"]), world=8)
    shorter = make_plan(compose(["+recipe=llama2_7b", f"target.name={target}", "data.max_length=1024"]), world=8)
    assert shorter.memory["attention scores (TTT)"] == base.memory["attention scores (TTT)"] // 2  # rows x2, T² /4
    more_ranks = make_plan(compose(["+recipe=llama2_7b", f"target.name={target}"]), world=16)
    assert more_ranks.memory["optimizer state"] < base.memory["optimizer state"]
    sized = make_plan(compose(["+recipe=llama2_7b", f"target.name={target}", "hotvocab.size=4096",
                               "data.max_samples=1000"]), world=8)
    assert sized.hot_vocab == 4096 and sized.tokens == 1000 * 2048
    with pytest.raises(LyannaError, match="cannot read the config"):
        make_plan(compose(["+recipe=llama2_7b", f"target.name={target.parent / 'nowhere'}"]))
    with pytest.raises(LyannaError, match="largest: "):
        check_fits(base, gpu_memory=1.0)
    assert base.memory_per_rank < 80 * GiB  # the recipe fits an 80 GB GPU on 8 ranks
