"""End-to-end builds: artifact contents, shard + merge == one pass, atomicity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.hotvocab import build as builder
from lyanna_train.hotvocab.artifact import load_counts, load_hot_vocab
from lyanna_train.hotvocab.counting import CountSettings
from lyanna_train.hotvocab.selection import SelectionRequest

from ..conftest import write_jsonl

QUIET = dict(progress=False, say=lambda *_: None)
REQUESTS = [SelectionRequest(ratio=0.01), SelectionRequest(size=300), SelectionRequest(coverage=0.8)]


@pytest.fixture()
def corpus(tmp_path, sharegpt_records):
    return str(write_jsonl(tmp_path / "corpus.jsonl", sharegpt_records))


@pytest.mark.slow
def test_artifact_has_every_promised_file_and_field(tmp_path, corpus, smollm2_tokenizer):
    out = tmp_path / "hv"
    manifest = builder.build([corpus], "smollm2", out, REQUESTS, CountSettings(heldout=0.1), **QUIET)
    names = {p.name for p in out.iterdir()}
    assert {"counts.safetensors", "manifest.json", "coverage.png", "report.md"} <= names
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    for key in ("tokenizer", "corpus", "count", "documents", "tokens", "skipped", "selections"):
        assert key in on_disk
    assert on_disk["tokenizer"]["fingerprint"].startswith("sha256:")
    assert on_disk["corpus"]["hash"].startswith("sha256:")
    eot = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eot in on_disk["always_include"]
    sizes = [s["size"] for s in on_disk["selections"]]
    assert sizes[:2] == [round(0.01 * 49152), 300]
    for sel in on_disk["selections"]:
        assert sel["file"] in names and 0 < sel["coverage_train"] <= 1 and 0 < sel["coverage_heldout"] <= 1
        hot = load_hot_vocab(out / sel["file"], expect_fingerprint=on_disk["tokenizer"]["fingerprint"])
        assert hot.size == sel["size"] and bool(hot.t2d[eot])
    goal = on_disk["selections"][2]
    assert goal["coverage_heldout"] >= 0.8
    _, train, heldout = load_counts(out)
    assert train.dtype == np.int64 and len(train) == len(heldout) == 49152


@pytest.mark.slow
def test_shards_merged_equal_one_pass(tmp_path, corpus):
    one = tmp_path / "one"
    builder.build([corpus], "smollm2", one, REQUESTS, CountSettings(heldout=0.1), **QUIET)
    shards = []
    for i in range(3):
        shards.append(tmp_path / f"shard{i}")
        builder.build([corpus], "smollm2", shards[-1], REQUESTS, CountSettings(heldout=0.1, shard=(i, 3)), **QUIET)
    merged = tmp_path / "merged"
    m = builder.merge([str(s) for s in shards], merged, REQUESTS, say=QUIET["say"])
    a, b = load_counts(one), load_counts(merged)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    single = json.loads((one / "manifest.json").read_text())
    assert [s["size"] for s in m["selections"]] == [s["size"] for s in single["selections"]]
    assert m["documents"] == single["documents"] and m["tokens"] == single["tokens"]
    for sel in single["selections"]:
        a, b = load_hot_vocab(one / sel["file"]), load_hot_vocab(merged / sel["file"])
        assert torch.equal(a.hot_ids, b.hot_ids) and torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)


@pytest.mark.slow
def test_merge_refuses_mismatched_tokenizers_and_duplicate_shards(tmp_path, corpus, header_template_dir):
    s0 = tmp_path / "s0"
    builder.build([corpus], "smollm2", s0, REQUESTS, CountSettings(shard=(0, 2)), **QUIET)
    with pytest.raises(LyannaError, match="given twice"):
        builder.merge([str(s0), str(s0)], tmp_path / "m", REQUESTS, say=QUIET["say"])
    other = tmp_path / "other"
    builder.build([corpus], str(header_template_dir), other, REQUESTS, CountSettings(shard=(1, 2)), **QUIET)
    # Same vocabulary, different template: the fingerprint covers the vocabulary, so a genuinely
    # different tokenizer is simulated by editing the manifest's fingerprint.
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "sha256:" + "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LyannaError, match="another tokenizer"):
        builder.merge([str(s0), str(other)], tmp_path / "m", REQUESTS, say=QUIET["say"])
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_interrupted_build_leaves_nothing_and_keeps_previous_output(tmp_path, corpus, monkeypatch):
    out = tmp_path / "hv"
    builder.build([corpus], "smollm2", out, REQUESTS, CountSettings(), **QUIET)
    before = (out / "manifest.json").read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "plot_coverage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        builder.build([corpus], "smollm2", out, REQUESTS, CountSettings(seed=5), overwrite=True, **QUIET)
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "hv"]
    with pytest.raises(KeyboardInterrupt):
        builder.build([corpus], "smollm2", tmp_path / "fresh", REQUESTS, CountSettings(), **QUIET)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "hv"]


def test_a_held_tokenizer_counts_as_the_loaded_one_and_is_not_loaded_again(tmp_path, corpus, smollm2_tokenizer,
                                                                            monkeypatch):
    """A training run hands its tokenizer to the build: the counts are those of a build that
    loads its own, and no tokenizer is loaded meanwhile."""
    from transformers import AutoTokenizer

    loaded = tmp_path / "loaded"
    builder.build([corpus], "smollm2", loaded, REQUESTS[:1], CountSettings(heldout=0.1), **QUIET)

    def refuse(*args, **kwargs):
        raise AssertionError("the build loaded a tokenizer although it was handed one")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    held = tmp_path / "held"
    builder.build([corpus], "smollm2", held, REQUESTS[:1], CountSettings(heldout=0.1), tokenizer=smollm2_tokenizer,
                  **QUIET)
    a, b = load_counts(loaded), load_counts(held)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    assert json.loads((held / "manifest.json").read_text())["tokenizer"]["fingerprint"] == \
        json.loads((loaded / "manifest.json").read_text())["tokenizer"]["fingerprint"]
