"""Every decoding setting declares its range once, beside its default: a value outside it is
refused with one line naming the field, whether it comes from a preset, a ``--set`` override
or code."""

from __future__ import annotations

import dataclasses

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.ranges import integer, ranged, rules
from lyanna_train.runtime.settings import DecodeSettings, TreeShape, load_decode_settings

from ..conftest import leaf_fields


def _built_with(dotted: str, value):
    """``DecodeSettings()`` with one leaf replaced, built in code (each dataclass checks itself)."""
    *path, last = dotted.split(".")
    if not path:
        return DecodeSettings(**{last: value})
    (group,) = path
    return DecodeSettings(**{group: dataclasses.replace(getattr(DecodeSettings(), group), **{last: value})})


def test_every_decoding_setting_has_an_allowed_range():
    assert sorted(leaf_fields(DecodeSettings)) == sorted(rules(DecodeSettings))


def test_a_setting_added_without_a_range_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Unranged(TreeShape):
        new_knob: int = 3  # no range: what a hurried change would add

    @dataclasses.dataclass(frozen=True)
    class Ranged(TreeShape):
        new_knob: int = ranged(3, integer(1))

    def schema(tree_cls):
        return dataclasses.make_dataclass("Schema", [("tree", tree_cls, dataclasses.field(default=tree_cls()))],
                                          frozen=True)

    assert "tree.new_knob" in rules(schema(Ranged))
    with pytest.raises(TypeError, match=r"Unranged\.new_knob declares no allowed range"):
        rules(schema(Unranged))


@pytest.mark.parametrize("dotted", leaf_fields(DecodeSettings))
def test_each_setting_is_checked_against_its_declared_range(dotted):
    """Its default is allowed; each value just outside the range is refused in code (naming the
    dataclass field) and, where a YAML value can carry it, by ``load_decode_settings`` (one line
    naming the dotted key, the value and the range)."""
    rule = rules(DecodeSettings)[dotted]
    default = DecodeSettings()
    for part in dotted.split("."):
        default = getattr(default, part)
    assert rule.ok(default), f"{dotted}: its default {default!r} is outside its range"
    assert rule.outside, f"{dotted}: its rule names no value outside the range"
    for value in rule.outside:
        with pytest.raises(ValueError, match=rf"\.{dotted.split('.')[-1]} = .* is not allowed \(allowed: "):
            _built_with(dotted, value)
    for value in rule.outside:
        if isinstance(default, bool) or isinstance(value, (bool, str)) or value != value or value == float("inf"):
            continue  # OmegaConf turns these into the field's type, or refuses them by type first
        if isinstance(value, float) and isinstance(default, int) and not isinstance(default, bool):
            continue  # a fraction for an integer field: OmegaConf's own one-line type error
        with pytest.raises(LyannaError) as err:
            load_decode_settings("default", [f"{dotted}={value}"])
        message = str(err.value)
        assert f": {dotted} = " in message and message.endswith(f"(allowed: {rule.allowed})"), message
        assert "\n" not in message


def test_a_value_of_the_wrong_type_in_a_preset_names_its_key(tmp_path):
    (tmp_path / "bad.yaml").write_text("tree:\n  depth: 0.5\n")
    with pytest.raises(LyannaError, match=r"tree\.depth") as err:
        load_decode_settings(str(tmp_path / "bad.yaml"))
    assert "\n" not in str(err.value)
