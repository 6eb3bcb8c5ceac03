"""A run folder or target folder from someone else never runs code: no pickle, no remote code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.training.loop import train

from .conftest import compose, tiny_overrides
from .test_train import _clean_env

TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0")


class _Payload:
    """Pickles to a call of ``exec``: loading it with plain pickle writes the marker file."""

    def __init__(self, marker):
        self.code = f"open({str(marker)!r}, 'w').write('code ran')"

    def __reduce__(self):
        return exec, (self.code,)


@pytest.mark.slow
def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path, tiny_target_dir, tiny_corpus):
    out, marker = tmp_path / "run", tmp_path / "marker"
    train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=1")))
    planted = out / "checkpoints" / "step-00000001" / "mp_rank_00_model_states.pt"
    state = torch.load(planted, weights_only=True)  # our own checkpoints hold plain tensors and data only
    torch.save({**state, "module": _Payload(marker)}, planted)
    with pytest.raises(LyannaError) as err:
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=2",
                                     "train.resume=force")))
    assert not marker.exists()
    message = str(err.value)
    assert message.startswith(f"refusing to load {planted.parent}: ") and "(the global exec)" in message


@pytest.mark.slow  # three train runs
def test_a_zero_checkpoint_resumes_weights_only_and_a_pickle_in_its_optimizer_file_never_runs(
        tmp_path, tiny_target_dir, tiny_corpus):
    """ZeRO (the GPU recipes' stage 2; stage 1 here, on CPU) keeps the optimizer in a file of its
    own, holding a few DeepSpeed records beside tensors: it must resume under weights_only, and
    that file is as guarded as the model's."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    zero = ("deepspeed.zero_stage=1", "train.save_every=1", "train.keep_last=5")
    train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, *zero, "train.max_steps=1")))
    result = train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, *zero, "train.max_steps=2",
                                          "train.resume=force")))
    assert result["step"] == 2  # resumed from step 1 with every file loaded weights_only
    (planted,) = (out / "checkpoints" / "step-00000002").glob("*optim_states.pt")
    from lyanna_train.training.deepspeed_engine import _deepspeed_records

    with torch.serialization.safe_globals(_deepspeed_records()):
        state = torch.load(planted, weights_only=True)
    state["lyanna_planted"] = _Payload(marker)
    torch.save(state, planted)
    with pytest.raises(LyannaError) as err:
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, *zero, "train.max_steps=3",
                                     "train.resume=force")))
    assert not marker.exists()
    assert str(err.value).startswith(f"refusing to load {planted.parent}: ") and "(the global exec)" in str(err.value)


def _evil_copy(src, dst, marker, model_type: str):
    """A model folder whose config and tokenizer point at Python files of its own (auto_map)."""
    shutil.copytree(src, dst)
    code = f"open({str(marker)!r}, 'a').write('code ran\\n')\n"
    (dst / "modeling_evil.py").write_text(code + "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                          "class EvilConfig(LlamaConfig):\n    model_type = 'lyanna-evil'\n"
                                          "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    (dst / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "modeling_evil.EvilConfig",
                                                   "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (dst / "config.json").write_text(json.dumps(config))
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    if model_type != "llama":  # a tokenizer class only its own code defines
        tok["tokenizer_class"] = "EvilTokenizer"
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


_LOAD = ("import sys\nfrom lyanna_train.errors import LyannaError\n"
         "from lyanna_train.target.source import load_tokenizer\nfrom lyanna_train.target.model import load_target_model\n"
         "try:\n    load_tokenizer(sys.argv[1]); load_target_model(sys.argv[1]); print('loaded')\n"
         "except LyannaError as err:\n    print('error:', err)\n")


@pytest.mark.parametrize("model_type", ["lyanna-evil", "llama"])
@pytest.mark.slow
def test_remote_code_in_a_target_folder_never_runs_whatever_stdin_says(tmp_path, tiny_target_dir, model_type):
    """transformers asks on stdin before running a folder's own code; a piped "y" used to run it.
    An unknown architecture is now refused in one line; a known one loads with transformers' own class."""
    marker = tmp_path / "marker"
    evil = _evil_copy(tiny_target_dir, tmp_path / "evil", marker, model_type)
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(evil)], input="y\n" * 10, capture_output=True, text=True,
                          timeout=300, env=_clean_env())
    assert not marker.exists(), proc.stdout + proc.stderr
    if model_type == "llama":
        assert proc.stdout.strip().endswith("loaded"), proc.stdout + proc.stderr
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "never runs" in lines[0], proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_cli_refuses_remote_code_with_one_line(tmp_path, tiny_target_dir, tiny_corpus):
    marker = tmp_path / "marker"
    evil = _evil_copy(tiny_target_dir, tmp_path / "evil", marker, "lyanna-evil")
    proc = subprocess.run([sys.executable, "-m", "lyanna_train.cli.hotvocab", "--corpus", str(tiny_corpus),
                           "--tokenizer", str(evil), "--out", str(tmp_path / "hot"), "--no-progress"],
                          input="y\n" * 10, capture_output=True, text=True, timeout=300, env=_clean_env())
    assert not marker.exists() and proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("lyanna-hotvocab: error:") and "never runs" in errors[0]
