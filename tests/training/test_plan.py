"""lyanna-plan on the Llama-2-7B and Llama-3-8B configs (written here: config.json only, no weights),
and offline on every recipe from the configs the package ships."""

from __future__ import annotations

import json
import socket
import time

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
    assert "for 100,000,000 tokens (at most)" in out
    assert "| data.feature_dtype=bfloat16 (this run) | 32,781 | 3,053.0 GiB |" in out
    assert "| data.feature_dtype=float8_e4m3fn | 16,413 | 1,528.6 GiB |" in out  # 4 fp32 scales per token
    # ZeRO-0 on one 16 GiB GPU: the bf16 target alone is 15 GiB
    assert plan_main(["+recipe=llama3_8b", f"target.name={target}", "deepspeed.zero_stage=0", "--gpu-memory", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lyanna-plan: error: the plan needs" in err[0] and "more than the 16.0 GiB" in err[0]


@pytest.mark.slow
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


@pytest.mark.slow
def test_phase_times_follow_the_stated_throughput(config_dir):
    target = config_dir("llama3", LLAMA3_8B)
    cfg = compose(["+recipe=llama3_8b", f"target.name={target}"])
    plan = make_plan(cfg, world=8, tokens=10**9)
    features, training = plan.phase_flops.values()
    # the target's forward: 2 FLOPs per weight but the input embedding's, plus causal attention
    assert features == 2 * (plan.target_params - 128256 * 4096) + 2 * 32 * 2048 * 4096
    assert training == 10 * 7 * (6 * plan.draft_params + 6 * 2048 * 4096)  # train=gpu: 10 epochs, 7 steps
    hours = plan.phase_hours(10**9)
    assert sum(hours.values()) == pytest.approx((features + training) * 1e9 / (8 * 400e12) / 3600)
    slower = make_plan(cfg, world=8, tokens=10**9, tflops=200)
    assert sum(slower.phase_hours(10**9).values()) == pytest.approx(2 * sum(hours.values()))
    online = make_plan(compose(["+recipe=llama3_8b", f"target.name={target}", "data.features=online"]), world=8)
    assert list(online.phase_flops.values())[0] == 10 * features  # the target runs again every epoch
    assert "target forward (online)" in online.memory
    hybrid = make_plan(compose(["+recipe=llama3_8b", f"target.name={target}", "data.features=hybrid"]), world=8)
    assert list(hybrid.phase_flops.values())[0] == features and "target forward (hybrid)" in hybrid.memory


def _recipes() -> list[str]:
    from lyanna_train.configs import recipes_dir

    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


@pytest.mark.parametrize("recipe", _recipes())
@pytest.mark.slow
def test_every_recipe_plans_offline_at_once(recipe, tmp_path, monkeypatch, capsys):
    """No model on disk (an empty Hugging Face cache) and no network (a connection raises):
    the recipe's target config ships with the package, and the plan answers in seconds."""
    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise AssertionError("lyanna-plan tried the network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr(socket.socket, "connect", no_network)
    start = time.perf_counter()
    assert plan_main([f"+recipe={recipe}", "--gpus", "8"]) == 0
    assert time.perf_counter() - start < 10
    out = capsys.readouterr().out
    assert "data.feature_dtype=bfloat16 (this run)" in out and "data.feature_dtype=float8_e4m3fn" in out
    assert "TFLOP/s sustained per GPU" in out and "**total**" in out


@pytest.mark.parametrize("hub_id,config", [("meta-llama/Llama-2-7b-chat-hf", LLAMA2_7B),
                                           ("lmsys/vicuna-7b-v1.5", LLAMA2_7B),
                                           ("meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B)])
@pytest.mark.slow
def test_shipped_configs_plan_as_the_published_ones(hub_id, config, config_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from lyanna_train.target.shipped_configs import shipped_hub_ids

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    assert hub_id in shipped_hub_ids()
    shipped = make_plan(compose([f"target.name={hub_id}"]), world=8)
    published = make_plan(compose([f"target.name={config_dir('published', config)}"]), world=8)
    assert shipped == published


def test_every_recipe_target_is_embedded_or_shipped():
    from lyanna_train.embedded import EMBEDDED_TARGETS
    from lyanna_train.target.shipped_configs import shipped_hub_ids

    for recipe in _recipes():
        name = compose([f"+recipe={recipe}"]).target.name
        assert name in EMBEDDED_TARGETS or name in shipped_hub_ids(), recipe
