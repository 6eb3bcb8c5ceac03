"""A plain (non-editable) install works outside the checkout: the wheel carries conf/ and
recipes/, and every recipe composes from another directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from lyanna_train.configs import recipes_dir

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
pytestmark = pytest.mark.slow  # builds a wheel and a venv (~30 s)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tree (links kept): setuptools' in-tree build/ folder could
    carry stale files into the wheel."""
    source, out = tmp_path_factory.mktemp("source") / "lyanna", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "checkpoints", "*.egg-info", "__pycache__", "outputs", "wandb"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(source)], check=True, capture_output=True, text=True)
    return next(out.glob("lyanna_train-*.whl"))


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    """A new venv holding only the wheel; the dependencies come from this interpreter's
    site-packages through a path file (which does not carry over its editable install)."""
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "outer_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_wheel_carries_every_config_and_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert f"lyanna_train/conf/{path.relative_to(ROOT / 'conf')}" in names
    for path in (ROOT / "recipes").glob("*.yaml"):
        assert f"lyanna_train/recipes/{path.name}" in names
    shipped = sorted((ROOT / "lyanna_train" / "target" / "model_configs").glob("*.json"))  # what lyanna-plan reads offline
    assert shipped and all(f"lyanna_train/target/model_configs/{path.name}" in names for path in shipped)


def test_every_recipe_composes_from_a_plain_install_elsewhere(fresh_venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LYANNA_CONF", "LYANNA_RECIPES", "PYTHONPATH")}
    code = ("import lyanna_train, sys; from lyanna_train.cli.plan import compose; "
            "from lyanna_train.runtime.settings import load_decode_settings, presets; "
            "print(lyanna_train.__file__); print(presets()); "
            f"[print(r, compose(['+recipe=' + r]).run_name) for r in {RECIPES!r}]")
    out = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith(str(fresh_venv)) and "site-packages" in out[0]  # the installed copy, not the checkout
    assert out[1] == "['chain', 'default', 'lookup_only']"
    assert out[2:] == [f"{r} {r}" for r in RECIPES]
    # the console script itself, as a user runs it
    shown = subprocess.run([str(fresh_venv / "bin" / "lyanna-train"), "+recipe=llama3_8b", "--cfg", "job"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout
    assert "zero_stage: 2" in shown and "Meta-Llama-3-8B-Instruct" in shown
    # a recipe's plan from the config the wheel ships: no model anywhere, no network
    planned = subprocess.run([str(fresh_venv / "bin" / "lyanna-plan"), "+recipe=llama2_7b"], cwd=tmp_path,
                             env={**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub-cache")},
                             check=True, capture_output=True, text=True).stdout
    assert "6.74 B parameters" in planned and "data.feature_dtype=float8_e4m3fn" in planned
