"""Dependency rules of the package layout, checked by parsing imports (see STYLE.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lyanna_train"
HEAVY_OPTIONAL = {"deepspeed", "wandb", "triton"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def _module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_heavy_optional_dependencies_are_never_imported_at_module_level_outside_their_owner():
    owners = {"deepspeed": "training", "wandb": "training", "triton": "runtime"}
    for path in PACKAGE.rglob("*.py"):
        for name in _module_level_imports(path) & HEAVY_OPTIONAL:
            assert owners[name] in path.relative_to(PACKAGE).parts, f"{path} imports {name} at module level"


def test_runtime_never_imports_training_code():
    runtime = PACKAGE / "runtime"
    for path in runtime.rglob("*.py") if runtime.exists() else []:
        for name in _imports(path):
            assert not any(bad in name for bad in ("training", "deepspeed", "wandb", "datasets", "hotvocab.build")), \
                f"{path} imports {name}"


def test_import_is_cheap_and_needs_no_accelerator_stack():
    code = "import sys, lyanna_train; print(sorted(m for m in ('torch','deepspeed','triton','wandb') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_engine_talks_to_deepspeed_and_only_tracking_to_wandb():
    owners = {"deepspeed": {"training/engine.py"}, "wandb": {"training/tracking.py"}}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        for name, allowed in owners.items():
            if any(n.split(".")[0] == name for n in _imports(path)):
                assert rel in allowed, f"{rel} imports {name}"
