"""What lyanna-train refuses, and how (issue 24): one line and exit 2 naming the file and the
cause, before the slow work, where each used to be a traceback (exit 1), Hydra's several
lines, or a refusal half a minute late."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.training.loop import train

from ..conftest import DAMAGED, write_damaged
from .conftest import compose, tiny_overrides
from .test_train import _clean_env

TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0")
ROOT = Path(__file__).resolve().parents[2]


def _cfg(target, corpus, out, *extra):
    return compose(tiny_overrides(target, corpus, out, *TINY, *extra))


@pytest.mark.parametrize("name", sorted(DAMAGED))
@pytest.mark.slow
def test_a_damaged_corpus_file_is_one_line_naming_it(tmp_path, tiny_target_dir, sharegpt_records, name):
    bad = write_damaged(tmp_path, name, sharegpt_records[:5])
    with pytest.raises(LyannaError) as err:
        train(_cfg(tiny_target_dir, bad, tmp_path / "run", "train.max_steps=1"))
    assert str(err.value).startswith(f"{bad} {DAMAGED[name]}") and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def finished_run(tiny_target_dir, tiny_corpus, tmp_path_factory):
    """(run folder, what the run printed) of a 2-step run that evaluates nothing."""
    out = tmp_path_factory.mktemp("finished") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=2"))
    return out, printed.getvalue()


@pytest.mark.slow
def test_the_last_line_of_a_run_without_final_metrics_ends_at_the_checkpoint(finished_run):
    out, printed = finished_run
    assert printed.splitlines()[-1] == f"done: step 2, checkpoint {out / 'checkpoints' / 'step-00000002'}"


@pytest.mark.slow
def test_a_checkpoint_without_deepspeeds_model_states_is_one_line(finished_run, tmp_path, tiny_target_dir,
                                                                  tiny_corpus):
    """Issue 24: DeepSpeed's bare AssertionError (no file found for its glob), exit 1."""
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    step = out / "checkpoints" / "step-00000002"
    (step / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(LyannaError) as err:
        train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=3", "train.resume=force"))
    assert str(err.value).startswith(f"cannot resume from {step}: DeepSpeed's model states "
                                     "(mp_rank_00_model_states.pt) are missing from it")


def _cli(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lyanna_train.cli.train", *overrides], capture_output=True,
                          text=True, timeout=300, env=env or _clean_env())


@pytest.mark.slow  # CLI subprocesses (a second or two each)
def test_hydras_own_errors_and_a_read_only_run_folder_are_one_line(read_only_dir, tmp_path, tiny_target_dir,
                                                                    tiny_corpus):
    """Hydra printed 7-13 lines for these (exit 1); a read-only train.out_dir failed in Hydra's
    own logging set-up (OSError or "Unable to configure handler 'file'"), before the project's check."""
    base = tiny_overrides(tiny_target_dir, tiny_corpus, tmp_path / "run", *TINY)
    cases = {"+recipe=nope": "config: In 'config': Could not find 'recipe/nope' (choose from llama2_7b, llama3_8b, "
                             "smollm2_135m, vicuna_7b)",
             "train.lr=abc": "config: Error merging override train.lr=abc: Value 'abc' of type 'str' could not be "
                             "converted to Float",
             f"train.out_dir={read_only_dir / 'run'}": f"cannot write run folder {read_only_dir / 'run'}: "}
    for override, words in cases.items():
        proc = _cli(*base, override)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"lyanna-train: error: {words}"), lines[0]
    assert not (tmp_path / "run").exists()  # refused before Hydra made the folder (and hydra/ in it)


@pytest.mark.slow  # a CLI subprocess
def test_a_busy_run_folder_is_refused_before_torch_and_deepspeed_are_imported(tmp_path, tiny_target_dir,
                                                                            tiny_corpus):
    """Issue 24: the second run was refused only after ~28 s of imports and DeepSpeed's op check.
    Here torch and deepspeed cannot even be imported by the second run: the refusal comes first."""
    from lyanna_train.locks import run_folder_lock

    out = tmp_path / "run"
    out.mkdir()
    blocked = tmp_path / "blocked"
    for module in ("torch", "deepspeed"):
        (blocked / module).mkdir(parents=True)
        (blocked / module / "__init__.py").write_text(f"raise ImportError('{module} imported before the refusal')\n")
    env = _clean_env() | {"PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT)])}
    with run_folder_lock(out):
        began = time.monotonic()
        proc = _cli(*tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY), env=env)
        took = time.monotonic() - began
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"lyanna-train: error: run folder {out} is in use by pid {os.getpid()}")
    assert took < 30  # seconds of a shared machine for what takes ~0.5 s alone; the old path could not even start
