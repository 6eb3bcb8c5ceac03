"""CONTRIBUTING.md's layout paragraph names every package, top-level module and benchmark script
of the tree, so a newcomer's map cannot silently fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("Layout: `lyanna_train/`")
    end = text.find("\n\n", start)
    return text[start:end if end > 0 else len(text)]


def test_layout_names_every_package_module_and_bench_script():
    layout = _layout()
    named = set(re.findall(r"`([^`]+)`", layout))
    package = ROOT / "lyanna_train"
    packages = {p.parent.name + "/" for p in package.glob("*/__init__.py")}
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")}
    missing = sorted((packages | modules | scripts) - named)
    assert not missing, f"README layout does not name: {missing}"
    for path in re.findall(r"`((?:lyanna_train|tests)/[\w/]+)`", layout):  # paths it names exist
        assert (ROOT / path).exists(), path
