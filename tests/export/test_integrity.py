"""Exports prove their bytes (sha256, finite weights); export reads the checkpoint alone and refuses
a draft for a target it was not trained on."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lyanna_train.cli.export import main as cli_main
from lyanna_train.errors import LyannaError
from lyanna_train.export import formats as F
from lyanna_train.export.reader import load_exported
from lyanna_train.export.writer import export_checkpoint
from lyanna_train.target.model import target_fingerprint

from .test_export import _rehash, _target, export, make_draft, make_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _tensor_span(path, name) -> tuple[int, int]:
    """Byte offsets of one tensor's data inside a safetensors file."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_len])
    start, end = header[name]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def test_flipped_bytes_in_a_weight_are_refused_naming_the_file(tmp_path, target, tok_fp):
    """2,000 flipped bytes inside lm_head.weight leave a perfectly readable safetensors file
    that used to load and decode with exit 0."""
    out = export(tmp_path, make_draft(target, pool=True), target, tok_fp, "lyanna")
    weights = out / F.WEIGHTS_FILE
    start, end = _tensor_span(weights, "lm_head.weight")
    data = bytearray(weights.read_bytes())
    for i in range(start, min(start + 2000, end)):
        data[i] ^= 0xFF
    weights.write_bytes(bytes(data))
    load_file(str(weights))  # still a valid file: only the checksum can tell
    with pytest.raises(LyannaError) as err:
        load_exported(out, target)
    assert f"{weights} is corrupted: its sha256" in str(err.value) and "\n" not in str(err.value)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, target, tok_fp):
    out = export(tmp_path, make_draft(target, pool=True), target, tok_fp, "lyanna")
    weights = out / F.WEIGHTS_FILE
    state = load_file(str(weights))
    state["fc.weight"] = torch.full_like(state["fc.weight"], float("nan"))
    with safe_open(str(weights), "pt") as fh:
        metadata = fh.metadata()
    save_file(state, str(weights), metadata=metadata)
    _rehash(out)  # a consistent export whose weights are NaN (a diverged run exported as is)
    with pytest.raises(LyannaError, match=r"tensor fc\.weight holds [\d,]+ non-finite values"):
        load_exported(out, target)


def test_export_refuses_a_checkpoint_with_non_finite_weights(tmp_path, target, tok_fp):
    draft = make_draft(target, pool=False)
    with torch.no_grad():
        draft.norm.weight[3] = float("inf")
    run = make_run(tmp_path / "run", draft, target, tok_fp)
    with pytest.raises(LyannaError, match=r"tensor norm\.weight holds 1 non-finite values"):
        export_checkpoint(run, tmp_path / "out", say=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_an_export_without_checksums_is_refused(tmp_path, target, tok_fp):
    out = export(tmp_path, make_draft(target, pool=False), target, tok_fp, "lyanna")
    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    del manifest["sha256"]
    (out / F.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(LyannaError, match="records no sha256"):
        load_exported(out, target)


@pytest.mark.parametrize("case", ["entry removed", "file added", "entry for no file", "entry outside"])
def test_the_manifest_lists_exactly_the_files_shipped(tmp_path, target, tok_fp, case):
    """Issue 24: with model.safetensors taken out of the sha256 map, flipped bytes in it loaded
    and decoded with exit 0."""
    out = export(tmp_path, make_draft(target, pool=True), target, tok_fp, "lyanna")
    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    weights = out / F.WEIGHTS_FILE
    if case == "entry removed":
        del manifest["sha256"][F.WEIGHTS_FILE]
        start, _ = _tensor_span(weights, "lm_head.weight")
        data = bytearray(weights.read_bytes())
        data[start] ^= 0x01
        weights.write_bytes(bytes(data))
    elif case == "file added":
        (out / "extra").mkdir()
        (out / "extra" / "notes.json").write_text("{}")
    elif case == "entry for no file":
        manifest["sha256"]["tokenizer.json"] = "0" * 64
    else:
        manifest["sha256"]["../run/secret"] = "0" * 64
    (out / F.MANIFEST_FILE).write_text(json.dumps(manifest))
    message = {"entry removed": f"{weights} has no sha256 in manifest.json",
               "file added": f"{out / 'extra' / 'notes.json'} has no sha256 in manifest.json",
               "entry for no file": "missing tokenizer.json in", "entry outside": "'../run/secret' is not a file inside"}
    with pytest.raises(LyannaError, match=re.escape(message[case])) as err:
        load_exported(out, target)
    assert "\n" not in str(err.value)


def test_export_reads_the_checkpoint_alone(tmp_path, target, tok_fp, monkeypatch):
    """A corrupt manifest in the run folder used to make export silently reload the target; now the
    run folder is never read: a checkpoint copied elsewhere exports the same, without the target."""
    import lyanna_train.target.model as model

    run = make_run(tmp_path / "run", make_draft(target, pool=True), target, tok_fp)
    (run / "features").mkdir()
    (run / "features" / "manifest.json").write_text("{corrupt")
    (run / "config.yaml").write_text(": not yaml :")
    alone = tmp_path / "elsewhere" / "step-00000001"
    shutil.copytree(run / "checkpoints" / "step-00000001", alone)

    def no_target(*args, **kwargs):
        raise AssertionError("export loaded the target although the checkpoint records its fingerprint")

    monkeypatch.setattr(model, "load_target_model", no_target)
    for source, name in ((run, "a"), (alone, "b")):
        export_checkpoint(source, tmp_path / name, say=lambda *_: None)
    a, b = (json.loads((tmp_path / n / F.MANIFEST_FILE).read_text()) for n in "ab")
    for manifest in (a, b):
        assert manifest["target"]["fingerprint"] == target_fingerprint(target)
        assert manifest["metrics"] == {"step": 1, "loss/total": 3.0, "eval/mean_tau": 1.5}
        assert manifest["training"]["run_config"] == {"train": {"lr": 0.001}}
    wa, wb = (load_file(str(tmp_path / n / F.WEIGHTS_FILE)) for n in "ab")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_corrupt_run_record_is_one_line(tmp_path, target, tok_fp, capsys):
    run = make_run(tmp_path / "run", make_draft(target, pool=False), target, tok_fp)
    (run / "checkpoints" / "step-00000001" / "run.json").write_text('{"target": {"fingerp')
    assert cli_main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "run.json is unreadable or not valid JSON" in err[0]


def test_export_for_another_target_is_refused(tmp_path, target, tok_fp, capsys):
    """lyanna-export --target OTHER used to exit 0 and stamp OTHER's fingerprint on the draft."""
    from lyanna_train.target.model import load_target_model

    same_dir, other_dir = tmp_path / "same-target", tmp_path / "other-target"
    target.save_pretrained(same_dir)
    _target(1).save_pretrained(other_dir)
    trained, other = load_target_model(str(same_dir)), load_target_model(str(other_dir))  # as the trainer saw it
    run = make_run(tmp_path / "run", make_draft(trained, pool=False), trained, tok_fp)
    capsys.readouterr()  # (save_pretrained's progress bars)
    assert cli_main([str(run), "--out", str(tmp_path / "out"), "--target", str(other_dir)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (and progress bars)
    assert len(err) == 1 and err[0].startswith("lyanna-export: error:") and "was trained on another target" in err[0]
    assert target_fingerprint(trained) in err[0] and target_fingerprint(other) in err[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(LyannaError, match="another target"):
        export_checkpoint(run, tmp_path / "out", target=other, say=lambda *_: None)
    assert cli_main([str(run), "--out", str(tmp_path / "out"), "--target", str(same_dir)]) == 0


def test_export_onto_a_read_only_place_is_one_line(read_only_dir, tmp_path, target, tok_fp, capsys):
    run = make_run(tmp_path / "run", make_draft(target, pool=False), target, tok_fp)
    out = read_only_dir / "export"
    assert cli_main([str(run), "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"lyanna-export: error: cannot write output {out}: "), err


def _fill(disk) -> None:
    """Fill ``disk`` to the last byte (a real full disk: later writes raise ENOSPC)."""
    import errno

    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tmp_path, target, tok_fp, capsys,
                                                                monkeypatch):
    import errno

    run = make_run(tmp_path / "run", make_draft(target, pool=False), target, tok_fp)
    disk = small_disk
    if disk is None:  # no tmpfs here: the first weight file fails as on a full disk
        import safetensors.torch

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
        disk = tmp_path / "disk"
        disk.mkdir()
    else:
        _fill(disk)
    out = disk / "export"
    assert cli_main([str(run), "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"lyanna-export: error: cannot write {out}: No space left on device"), err
    assert sorted(p.name for p in disk.iterdir()) == ([] if small_disk is None else ["filler"])  # no partial, no lock
