"""Every recipe and the base config compose against the typed schema; bad configs are refused."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from lyanna_train.cli.train import take_local_rank
from lyanna_train.configs import recipes_dir
from lyanna_train.errors import LyannaError
from lyanna_train.training.config import Config, validate

from .conftest import compose

RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def test_the_promised_recipes_exist():
    assert {"llama2_7b", "vicuna_7b", "llama3_8b", "smollm2_135m"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow
def test_recipe_composes_and_validates(recipe):
    cfg = compose([f"+recipe={recipe}"])
    validate(cfg)
    assert isinstance(OmegaConf.to_object(cfg), Config)
    assert cfg.run_name == recipe and cfg.train.out_dir == f"checkpoints/{recipe}"
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header and text.startswith("# ")  # purpose first, then the command that runs it
    assert any("+recipe=" + recipe in line for line in header)


def test_design_recipes_carry_the_design_settings():
    for name in ("llama2_7b", "vicuna_7b"):
        cfg = compose([f"+recipe={name}"])
        assert cfg.deepspeed.zero_stage == 2 and cfg.deepspeed.precision == "bf16"
        assert cfg.hotvocab.ratio == 0.05 and cfg.draft.pool_size == 512
        assert cfg.draft.alpha_max == 0.3 and cfg.draft.pool_threshold == 0.85


@pytest.mark.parametrize("override,message", [
    ("data.features=sometimes", "data.features"),
    ("loss.out_of_vocab=drop", "loss.out_of_vocab"),
    ("hotvocab.ratio=1.5", "hotvocab.ratio = 1.5 is not allowed (allowed: a finite number in (0, 1])"),
    ("data.corpus=[mtbench]", "evaluation set"),
    ("deepspeed.zero_stage=3", "zero_stage"),
])
@pytest.mark.slow
def test_bad_config_is_named(override, message):
    with pytest.raises(LyannaError, match=re.escape(message)):
        validate(compose(["+recipe=smollm2_135m", override]))


def test_schema_rejects_unknown_keys_and_wrong_types():
    with pytest.raises(LyannaError, match="learning_rate"):
        compose(["train.learning_rate=0.1"])
    with pytest.raises(LyannaError, match="epochs"):
        compose(["train.epochs=many"])


def _leaves(node, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_writes_only_what_differs_from_the_base(recipe):
    """A recipe is a difference: its group choices (defaults list) and the values that
    differ from what the base config, with those choices, already gives."""
    raw = OmegaConf.load(recipes_dir() / f"{recipe}.yaml")
    choices = [f"{key.removeprefix('override /')}={value}" for entry in raw.get("defaults", [])
               if OmegaConf.is_dict(entry) for key, value in entry.items()]
    base = compose(choices)
    body = OmegaConf.masked_copy(raw, [k for k in raw if k != "defaults"])
    repeated = {k: v for k, v in _leaves(body).items() if OmegaConf.select(base, k) == v}
    assert not repeated, f"{recipe} repeats the base config: {repeated}"


def test_every_config_group_option_is_used():
    """Each file under conf/<group>/ is the base's choice or chosen by a recipe, a variant
    (draft=no_pool, hotvocab=full) or a decoding preset: no orphans like an unused ZeRO file."""
    from lyanna_train.configs import conf_dir

    used = set()
    for path in [conf_dir() / "config.yaml", *recipes_dir().glob("*.yaml")]:
        for entry in OmegaConf.load(path).get("defaults", []):
            if OmegaConf.is_dict(entry):
                used |= {f"{k.removeprefix('override /')}/{v}" for k, v in entry.items()}
    used |= {"draft/no_pool", "hotvocab/full"}  # ablation variants
    options = {f"{p.parent.name}/{p.stem}" for p in conf_dir().glob("*/*.yaml") if p.parent.name != "decode"}
    assert options <= used, f"unused config files: {sorted(options - used)}"


def test_config_groups_choose_between_alternatives_and_restate_no_default():
    """Defaults live in the dataclasses (training/config.py): a group exists only where it
    chooses between alternatives, and an option writes only what it changes."""
    from lyanna_train.configs import conf_dir

    schema = OmegaConf.structured(Config)
    groups = {p for p in conf_dir().iterdir() if p.is_dir() and p.name != "decode"}
    assert groups
    for group in groups:
        options = sorted(group.glob("*.yaml"))
        assert len(options) >= 2, f"conf/{group.name} has one option: its values belong in the dataclass defaults"
        for path in options:
            raw = OmegaConf.load(path)
            assert "defaults" not in raw, f"{path.name}: an option extends nothing (its base is the schema)"
            repeated = {k: v for k, v in _leaves(raw).items() if OmegaConf.select(schema[group.name], k) == v}
            assert not repeated, f"conf/{group.name}/{path.name} restates the defaults: {repeated}"


def test_launcher_local_rank_is_taken_out_of_argv(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert take_local_rank(["--local_rank=1", "+recipe=x", "a=b"]) == ["+recipe=x", "a=b"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    assert take_local_rank(["--local_rank", "0", "a=b"]) == ["a=b"] and os.environ["LOCAL_RANK"] == "0"


def test_first_tokens_keeps_whole_leading_shards():
    from lyanna_train.training.batches import first_tokens

    lengths = [[3, 4], [5], [2, 2], [9]]
    assert first_tokens(lengths, None) == lengths
    assert first_tokens(lengths, 12) == [[3, 4], [5], [], []]
    assert first_tokens(lengths, 16) == [[3, 4], [5], [2, 2], []]
    assert first_tokens(lengths, 1) == [[3, 4], [], [], []]  # at least one shard
