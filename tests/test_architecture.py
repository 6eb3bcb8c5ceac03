"""Dependency rules of the package layout, checked by parsing imports (see STYLE.md).

``ALLOWED`` is the architecture: for each area of ``lyanna_train`` (a subpackage, or a
top-level module), the areas it may import — at module level or inside a function
alike. An import that is not in the table fails the test with the edge it would add;
adding an edge is a design decision, made here in the open.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lyanna_train"
HEAVY_OPTIONAL = {"deepspeed", "wandb", "triton"}

BASE = {"errors", "atomic", "locks", "embedded", "configs", "ranges", "run_record", "__init__"}  # leaf modules anything may use
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "atomic": {"errors"},
    "run_record": {"errors", "atomic"},  # a checkpoint's name and run.json: training writes them, export reads them
    "locks": {"errors", "atomic"},  # output_lock checks writability before taking the lock
    "embedded": {"errors"},
    "configs": set(),
    "ranges": {"errors"},  # declared ranges: the training config's and the decoding settings'
    "__init__": set(),
    "target": BASE,
    "data": BASE | {"target"},
    "hotvocab": BASE | {"target", "data"},
    "models": BASE,
    "losses": BASE,
    # serving: the draft, the target's hooks and the export reader; never training code
    "runtime": BASE | {"models", "target", "export"},
    "evaluation": BASE | {"runtime", "models", "target"},
    # the HTTP server: the runtime, prompt rendering and the export reader; never training code
    "serving": BASE | {"runtime", "evaluation", "models", "target", "export"},
    "export": BASE | {"models", "target", "hotvocab"},
    "training": BASE | {"target", "data", "hotvocab", "models", "losses", "evaluation", "export"},
    "cli": BASE | {"target", "data", "hotvocab", "models", "losses", "runtime", "evaluation", "export", "training",
                   "serving"},
}
# Module-level exceptions to an edge above: (importing module, imported area) -> allowed modules.
NARROW = {
    ("runtime", "export"): {"export.reader"},  # serving reads exports, never the writer (which reads checkpoints)
    ("serving", "export"): {"export.reader"},
    ("training", "export"): {"export.reader"},  # fine-tuning starts from an exported head
}
# Edges that must not come back, between areas or between modules inside one (the tables above
# only govern areas): (importing module or area, imported module or area) -> where what it came
# for lives instead, or why not. An area named here must not be in ALLOWED either.
FORBIDDEN = {
    ("cli.plan", "cli.train"): "use configs.register_configs (cli.train imports cli.plan: no circle)",
    ("export", "training"): "use run_record (checkpoint names, run.json); training imports export.reader",
    ("runtime", "training"): "serving runs on torch + transformers alone, never the trainer",
    ("serving", "training"): "serving runs on torch + transformers alone, never the trainer",
    ("evaluation", "training"): "the benchmarks measure exports; training evaluates through evaluation, not back",
}


def _area(relative: Path) -> str:
    return relative.with_suffix("").parts[0]


def _internal_imports(path: Path) -> set[str]:
    """Dotted names of lyanna_train modules imported by ``path``, relative to the package
    (``__init__`` for the package itself)."""
    package = list(path.relative_to(PACKAGE).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.removeprefix("lyanna_train.") for a in node.names if a.name.startswith("lyanna_train.")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            if node.module:
                names.add(".".join(base))
            else:  # ``from .. import x``: x is a module of that package, or a name defined in it
                for alias in node.names:
                    module = PACKAGE.joinpath(*base, alias.name)
                    is_module = module.is_dir() or module.with_suffix(".py").exists()
                    names.add(".".join(base + [alias.name]) if is_module else ".".join(base) or "__init__")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lyanna_train."):
            names.add(node.module.removeprefix("lyanna_train."))
    return names


def _edges():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        for name in _internal_imports(path):
            yield rel, _area(rel), name, name.split(".")[0]


@pytest.mark.slow
def test_every_import_between_areas_is_an_allowed_edge():
    unknown = {area for _, area, _, _ in _edges()} - set(ALLOWED)
    assert not unknown, f"areas missing from the ALLOWED table: {unknown}"
    bad = []
    for rel, area, name, target in _edges():
        if target == area:
            continue
        if target not in ALLOWED[area]:
            bad.append(f"{rel} imports {name}: {area} -> {target} is not an allowed edge")
        elif (area, target) in NARROW and not any(name == m or name.startswith(m + ".")
                                                  for m in NARROW[area, target]):
            bad.append(f"{rel} imports {name}: {area} may only use {sorted(NARROW[area, target])}")
    assert not bad, "\n".join(bad)


# The runtime's parts, each importing only parts before it: the policy prices trees without
# knowing how they are drafted, drafting asks the policy which rows draft, verification rolls
# the draft state to what the target accepted, the scheduler drives them all, the CPU tuning
# times their forwards.
RUNTIME_ORDER = ["settings", "token_tree", "kernels", "pricing", "drafting", "verification", "scheduling", "cpu",
                 "served_models"]


def test_the_runtimes_parts_import_only_the_parts_before_them():
    parts = {p.stem if p.is_file() else p.name for p in (PACKAGE / "runtime").iterdir()
             if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists() or p.is_dir())
             and p.name != "__pycache__"}
    assert parts == set(RUNTIME_ORDER), f"parts missing from RUNTIME_ORDER or gone: {parts ^ set(RUNTIME_ORDER)}"
    bad = []
    for rel, area, name, _ in _edges():
        if area != "runtime" or len(rel.parts) < 2 or not name.startswith("runtime."):
            continue
        here, there = rel.with_suffix("").parts[1], name.split(".")[1]
        if here != there and RUNTIME_ORDER.index(there) > RUNTIME_ORDER.index(here):
            bad.append(f"{rel} imports {name}: runtime/{here} may not use runtime/{there}, which comes after it")
    assert not bad, "\n".join(bad)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_forbidden_edge():
    assert not [(a, b) for a, b in FORBIDDEN if a in ALLOWED and b in ALLOWED[a]], "ALLOWED holds a FORBIDDEN edge"
    bad = [f"{rel} imports {name}: {FORBIDDEN[importer, forbidden]}"
           for rel, _, name, _ in _edges()
           for importer, forbidden in FORBIDDEN
           if _within(".".join(rel.with_suffix("").parts), importer) and _within(name, forbidden)]
    assert not bad, "\n".join(bad)


def test_the_table_has_no_cycles_between_areas():
    """Edges point one way. A NARROW edge counts as the edges of the modules it allows
    (``training -> export`` is only ``export.reader``)."""
    graph = {a: {b for b in deps if b in ALLOWED and b != a} for a, deps in ALLOWED.items()}
    for (area, target), modules in NARROW.items():
        graph[area].discard(target)
        for module in modules:
            path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
            graph[area] |= {n.split(".")[0] for n in _internal_imports(path)} - {target, area}
    seen, stack = set(), []

    def visit(node):
        assert node not in stack, f"cycle: {' -> '.join(stack + [node])}"
        if node in seen:
            return
        stack.append(node)
        for nxt in graph[node]:
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in graph:
        visit(node)


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


def test_runtime_and_evaluation_never_import_training_libraries():
    for area in ("runtime", "evaluation", "serving"):
        for path in (PACKAGE / area).rglob("*.py"):
            for name in _imports(path):
                assert name.split(".")[0] not in ("deepspeed", "wandb", "datasets"), f"{path} imports {name}"


def test_import_is_cheap_and_needs_no_accelerator_stack():
    code = "import sys, lyanna_train; print(sorted(m for m in ('torch','deepspeed','triton','wandb') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_serving_never_loads_training_code():
    """What lyanna-generate and lyanna-serve import (the runtime, its served models, evaluation's prompts, the
    HTTP server) pulls in no trainer."""
    code = ("import sys, lyanna_train.runtime.served_models, lyanna_train.runtime.scheduling.scheduler, lyanna_train.evaluation.benchmark, "
            "lyanna_train.serving.server, lyanna_train.cli.serve; "
            "print(sorted(m for m in sys.modules if m.startswith('lyanna_train.training') or m.split('.')[0] in "
            "('deepspeed', 'wandb', 'datasets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_only_the_engine_talks_to_deepspeed_and_only_tracking_to_wandb():
    owners = {"deepspeed": {"training/deepspeed_engine.py"}, "wandb": {"training/tracking.py"}}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        for name, allowed in owners.items():
            if any(n.split(".")[0] == name for n in _imports(path)):
                assert rel in allowed, f"{rel} imports {name}"


def test_bench_scripts_and_data_tools_use_public_names_only():
    """Scripts outside the package are its users: a private name they import can change under them."""
    root = Path(__file__).resolve().parents[1]
    private = []
    for path in sorted([*root.glob("bench/*.py"), *root.glob("data_tools/*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = {}  # local name -> lyanna_train module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lyanna_train"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                modules.update({a.asname or a.name: node.module for a in node.names})
            elif isinstance(node, ast.Import):
                modules.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("lyanna_train")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                private.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not private, private
