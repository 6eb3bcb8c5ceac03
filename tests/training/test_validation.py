"""Every config value is checked before any work: one line naming the field, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.ranges import check_values, integer, ranged, rules
from lyanna_train.training.config import Config, TrainConf
from lyanna_train.training.loop import train

from ..conftest import leaf_fields
from .conftest import compose, tiny_overrides

TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0")


def test_every_config_field_has_an_allowed_range():
    assert sorted(leaf_fields(Config)) == sorted(rules(Config))


def test_a_field_added_without_a_range_is_refused():
    @dataclasses.dataclass
    class Ranged(TrainConf):
        new_knob: int = ranged(3, integer(1))

    @dataclasses.dataclass
    class Unranged(TrainConf):
        new_knob: int = 3  # no range: what a hurried change would add

    def schema(train_conf):
        return dataclasses.make_dataclass("Schema", [("train", train_conf, dataclasses.field(default_factory=train_conf))])

    assert "train.new_knob" in rules(schema(Ranged))
    with pytest.raises(TypeError, match=r"Unranged\.new_knob declares no allowed range"):
        rules(schema(Unranged))


def _default(dotted: str):
    node = Config()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _with(dotted: str, value) -> Config:
    cfg = Config()
    *path, last = dotted.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)
    return cfg


@pytest.mark.parametrize("dotted", leaf_fields(Config))
def test_each_field_is_checked_against_its_declared_range(dotted):
    """Every field's own range, from its declaration: its default is allowed, and each value
    just outside the range is refused with one line naming the field, the value and the range."""
    rule = rules(Config)[dotted]
    assert rule.ok(_default(dotted)), f"{dotted}: its default {_default(dotted)!r} is outside its range"
    assert rule.outside, f"{dotted}: its rule names no value outside the range"
    for value in rule.outside:
        with pytest.raises(LyannaError) as err:
            check_values(_with(dotted, value), Config)
        message = str(err.value)
        assert message.startswith(f"config: {dotted} = ") and message.endswith(f"(allowed: {rule.allowed})"), message
        assert "\n" not in message and "is not allowed" in message


def test_the_schema_loads_without_torch():
    """Composing a config (lyanna-train's one-second refusals) must not wait for torch: the
    ranges whose names live beside torch code are read only when a value is checked."""
    import subprocess
    import sys

    code = ("import sys, lyanna_train.training.config as c, lyanna_train.ranges as v; "
            "v.rules(c.Config); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("override,shown,allowed", [
    ("hotvocab.size=-5", "hotvocab.size = -5", "null or an integer >= 1"),
    ("train.lr=-1", "train.lr = -1.0", "a finite number in (0, 1]"),
    ("train.lr=nan", "train.lr = nan", "a finite number in (0, 1]"),
    ("target.dtype=float64x", "target.dtype = 'float64x'", "one of auto, float32, bfloat16, float16"),
    ("train.threads=-1", "train.threads = -1", "null or an integer >= 1"),
    ("train.epochs=0", "train.epochs = 0", "an integer >= 1"),
    ("draft.pool_size=64", "draft.pool_size = 64", "0 (pool off) or an integer >= 128"),
    ("deepspeed.betas=[0.9,1.5]", "deepspeed.betas = [0.9, 1.5]", "two numbers in [0, 1)"),
    ("target.aux_layers=[1,1]", "target.aux_layers = [1, 1]", "distinct layer indices"),
    ("data.corpus=[]", "data.corpus = []", "a non-empty list"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens = 0", "an integer >= 1"),
])
@pytest.mark.slow
def test_a_bad_value_stops_the_run_before_any_work(tmp_path, tiny_target_dir, tiny_corpus, override, shown, allowed):
    out = tmp_path / "run"
    with pytest.raises(LyannaError) as err:
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, override)))
    message = str(err.value)
    assert message.startswith(f"config: {shown} is not allowed (allowed: ") and allowed in message, message
    assert "\n" not in message
    assert not out.exists()  # nothing was built: the folder is as usable as before


@pytest.mark.parametrize("override,message", [
    ("hotvocab.path=/no/such/hot-100.safetensors", "hotvocab.path = '/no/such/hot-100.safetensors' does not exist"),
    ("train.resume=/no/such/step-00000001", "train.resume = '/no/such/step-00000001' is not allowed"),
    ("data.corpus=[/no/such/corpus.jsonl]", "data.corpus"),
    ("draft.init_from=/no/such/export", "draft.init_from = '/no/such/export' is not an export directory"),
])
@pytest.mark.slow
def test_missing_inputs_are_named_before_any_work(tmp_path, tiny_target_dir, tiny_corpus, override, message):
    out = tmp_path / "run"
    with pytest.raises(LyannaError, match=re.escape(message)):
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, override)))
    assert not out.exists()


@pytest.mark.slow
def test_hot_vocabulary_sizes_are_checked_against_the_tokenizer_and_the_given_file(
        tmp_path, tiny_target_dir, tiny_corpus):
    from lyanna_train.hotvocab.artifact import save_hot_vocab
    from lyanna_train.hotvocab.selection import HotVocab
    from lyanna_train.target.fingerprint import tokenizer_fingerprint
    from lyanna_train.target.source import load_tokenizer

    out = tmp_path / "run"
    with pytest.raises(LyannaError, match=re.escape("hotvocab.size = 1000000 is not allowed (allowed: 1 to the "
                                                    "vocabulary size, 49152)")):
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "hotvocab.size=1000000")))
    assert not (out / "hotvocab").exists()  # refused before the hot vocabulary was built
    fingerprint = tokenizer_fingerprint(load_tokenizer(str(tiny_target_dir)))
    save_hot_vocab(tmp_path, HotVocab.from_ids(list(range(100)), 49152), fingerprint)
    with pytest.raises(LyannaError, match=re.escape("hotvocab.size = 1000, but hotvocab.path")):
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "hotvocab.size=1000",
                                     f"hotvocab.path={tmp_path / 'hot-100.safetensors'}")))
