"""Training on a disk that fills up or cannot be written: one line naming the path and the cause."""

from __future__ import annotations

import errno

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.training.loop import train

from .conftest import compose, tiny_overrides

TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0")


@pytest.fixture(scope="module")
def tiny_hot_vocab(tiny_target_dir, tiny_corpus, tmp_path_factory):
    from lyanna_train.hotvocab.build import build
    from lyanna_train.hotvocab.counting import CountSettings
    from lyanna_train.hotvocab.selection import SelectionRequest

    out = tmp_path_factory.mktemp("hot") / "hot"
    build([str(tiny_corpus)], str(tiny_target_dir), out, [SelectionRequest(size=2458)], CountSettings(),
          progress=False, say=lambda *_: None)
    return out


@pytest.mark.slow
def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_leaves_no_partial(
        small_disk, tmp_path, monkeypatch, tiny_target_dir, tiny_corpus, tiny_hot_vocab):
    """It used to end in a traceback ("basic_ios::clear: iostream error", "unexpected pos") and
    left the half-written .partial-step-* behind."""
    disk = small_disk
    if disk is None:  # no tmpfs here: DeepSpeed's torch.save fails as on a full disk
        import torch

        def full(obj, path, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(torch, "save", full)
        disk = tmp_path / "disk"
        disk.mkdir()
    out = disk / "run"  # hot vocabulary and features live elsewhere: only the run folder is on the small disk
    cfg = compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=1",
                                 f"hotvocab.path={tiny_hot_vocab}", f"data.cache_dir={tmp_path / 'features'}"))
    with pytest.raises(LyannaError) as err:
        train(cfg)
    message = str(err.value)
    assert message.startswith(f"cannot save checkpoint {out / 'checkpoints' / 'step-00000001'}: No space left on device")
    assert "\n" not in message
    assert list((out / "checkpoints").iterdir()) == []
    assert not (out / ".lock").exists()  # the folder is free again


def test_a_read_only_run_folder_is_refused_before_any_work(read_only_dir, tiny_target_dir, tiny_corpus):
    out = read_only_dir / "run"
    with pytest.raises(LyannaError) as err:
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=1")))
    message = str(err.value)
    assert message.startswith(f"cannot write run folder {out}: ") and "\n" not in message
