"""Every command written in a recipe header or in the README parses with the real parser.

``lyanna-*`` entry points and the scripts in ``bench/`` and ``data_tools/`` go through
their own argparse parser (stopped right after parsing: nothing runs); ``lyanna-train``
and ``lyanna-plan`` overrides compose with Hydra against the shipped configs; a
``deepspeed`` line goes through DeepSpeed's own launcher parser, then its user arguments
through ``lyanna-train``'s. A command whose program is not known here fails the test, so
a new kind of command gets checked too.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from lyanna_train.configs import recipes_dir

ROOT = Path(__file__).resolve().parents[1]
NOT_PARSED = ("make", ".venv/bin/python -m pytest")  # build and test tooling, not ours to parse
# The engines' own commands (README, "Serving with SGLang / vLLM"): their parsers are not
# installed here; bench/engine_load_check.py runs them where a GPU is lent.
ENGINES = ("vllm ", "python -m sglang", "VERIFIER=")


def _recipe_commands() -> list[tuple[str, str]]:
    out = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        for line in path.read_text().splitlines():
            body = line.removeprefix("#").strip()
            if line.startswith("#   ") and re.match(r"(lyanna-|deepspeed |python )", body):
                out.append((f"recipes/{path.name}", body.split("  #")[0].strip()))
    return out


def _readme_commands() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#") and not command.startswith(ENGINES):
                out.append(("README.md", command))
    for inline in re.findall(r"`((?:python |lyanna-|deepspeed )[^`]+)`", text):
        if len(inline.split()) > 2:  # a command with arguments, not a program's (sub)command named in prose
            out.append(("README.md", " ".join(inline.split())))
    return out


COMMANDS = _recipe_commands() + _readme_commands()


class _Parsed(Exception):
    """Raised by the patched parse_args once the real parser has accepted the arguments."""


@pytest.fixture
def parse_only(monkeypatch):
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _argparse(main, argv: list[str]):
    with pytest.raises(_Parsed) as parsed:
        main(argv)
    return parsed.value.args[0]


def _script(path: str, argv: list[str], monkeypatch):
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(script), run_name="__main__")
    return parsed.value.args[0]


def _compose(overrides: list[str]):
    from lyanna_train.cli.plan import compose
    from lyanna_train.training.config import validate

    cfg = compose(overrides)
    validate(cfg, paths=False)  # written for another machine: /models/... need not exist here
    return cfg


def check(command: str, monkeypatch):
    from lyanna_train.cli import bench, export, generate, hotvocab, plan, serve

    argv = shlex.split(command)
    program, args = argv[0], argv[1:]
    if program == "lyanna-train":
        if "--plan" in args:  # planned instead of run: lyanna-plan's parser
            return _compose(_argparse(plan.main, [a for a in args if a != "--plan"]).overrides)
        return _compose(args)
    if program == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        try:  # DeepSpeed's own parser: `-m` is not one of its flags, `--module` is
            launch = parse_args(args)
        except _Parsed as parsed:  # under parse_only
            launch = parsed.args[0]
        assert launch.module and launch.user_script == "lyanna_train.cli.train", command
        return _compose(launch.user_args)
    if program == "lyanna-plan":
        namespace = _argparse(plan.main, args)
        return _compose(namespace.overrides)
    mains = {"lyanna-bench": bench.main, "lyanna-export": export.main, "lyanna-generate": generate.main,
             "lyanna-hotvocab": hotvocab.main, "lyanna-serve": serve.main}
    if program in mains:
        return _argparse(mains[program], args)
    if program in ("python", ".venv/bin/python") and args and args[0].endswith(".py"):
        return _script(args[0], args[1:], monkeypatch)
    raise AssertionError(f"no parser known for {program!r}: {command}")


def test_commands_were_found():
    where = {w for w, _ in COMMANDS}
    assert {"README.md", "recipes/llama2_7b.yaml", "recipes/llama3_8b.yaml", "recipes/vicuna_7b.yaml",
            "recipes/smollm2_135m.yaml"} <= where
    assert any(c.startswith("deepspeed ") for _, c in COMMANDS)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
@pytest.mark.slow
def test_command_parses(where, command, parse_only, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing a parser might touch lands in the checkout
    if command.startswith(NOT_PARSED):
        pytest.skip("build and test tooling")
    check(command, monkeypatch)


def test_a_wrong_command_is_caught(parse_only, monkeypatch):
    with pytest.raises(SystemExit):  # DeepSpeed 0.19's launcher: "unrecognized arguments: -m"
        check("deepspeed --num_gpus 8 -m lyanna_train.cli.train +recipe=llama2_7b", monkeypatch)
    with pytest.raises(SystemExit):
        check("lyanna-bench --draft DIR --prompt-count 16", monkeypatch)  # no such flag
    with pytest.raises(Exception, match="train.learning_rate|learning_rate"):
        check("lyanna-train +recipe=smollm2_135m train.learning_rate=0.1", monkeypatch)
