"""Feature cache: round trip, resumable and deterministic builds, corruption, fingerprints, --shard I/N."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from lyanna_train.data.batching import pad_right
from lyanna_train.data.feature_cache import FeatureCache, shard_path
from lyanna_train.data.feature_cache_writer import CacheSettings, build_feature_cache
from lyanna_train.data.features import FeatureExtractor
from lyanna_train.data.samples import Sample
from lyanna_train.errors import LyannaError
from lyanna_train.target.fingerprint import tokenizer_fingerprint
from lyanna_train.target.model import load_target_model, target_fingerprint

from .test_features import other_target_dir, tiny_target, tiny_target_dir  # noqa: F401 - fixtures

LAYERS = (0, 1, 2)
SETTINGS = CacheSettings(max_length=40, shard_tokens=150, batch_tokens=96)


def _samples(n: int = 36) -> list[Sample]:
    """Variable lengths (some cut at max_length, as building samples does), some without any
    loss token (skipped)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 55, (1,), generator=g))
        ids = torch.randint(3, 256, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        if i % 7 != 3:  # every 7th sample has no assistant token
            start = int(torch.randint(0, length, (1,), generator=g))
            mask[start:] = True
        out.append(Sample(100 + i, ids[: SETTINGS.max_length], mask[: SETTINGS.max_length]))
    return out


class Interrupted:
    """Re-iterable samples whose second reading (the computing pass) stops after ``stop`` samples."""

    def __init__(self, samples, stop: int):
        self.samples, self.stop, self.reads = samples, stop, 0

    def __iter__(self):
        self.reads += 1
        for pos, sample in enumerate(self.samples):
            if self.reads == 2 and pos == self.stop:
                raise KeyboardInterrupt
            yield sample


def _build(samples, model, tokenizer, out, **kw):
    said: list[str] = []
    kw.setdefault("settings", SETTINGS)
    result = build_feature_cache(samples, model, tokenizer, out, layer_ids=LAYERS, progress=False,
                                 say=said.append, **kw)
    return result, "\n".join(said)


def _files(root) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "shards").iterdir()) if not p.name.startswith(".")}


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory, tiny_target, smollm2_tokenizer):  # noqa: F811
    out = tmp_path_factory.mktemp("cache") / "ref"
    result, _ = _build(_samples(), tiny_target, smollm2_tokenizer, out)
    return out, result


@pytest.mark.slow
def test_round_trip_matches_direct_features(reference_cache, tiny_target, smollm2_tokenizer):  # noqa: F811
    out, result = reference_cache
    samples = _samples()
    kept = [s for s in samples if s.loss_mask[: SETTINGS.max_length].any()]
    assert result.complete and result.shards_total > 3 and result.shards_written == result.shards_total
    assert result.tokens_computed == sum(min(len(s), SETTINGS.max_length) for s in kept)
    cache = FeatureCache(out, target_fingerprint(tiny_target), tokenizer_fingerprint(smollm2_tokenizer), LAYERS)
    manifest = cache.manifest
    assert manifest["totals"]["samples"] == len(kept) and manifest["totals"]["skipped_no_loss_tokens"] == len(samples) - len(kept) == 6
    assert manifest["layers"]["ids"] == list(LAYERS) and manifest["dtype"] == "bfloat16"
    fx = FeatureExtractor(tiny_target, LAYERS)
    read = list(cache.iter_samples())
    assert [r["index"] for r in read] == [s.index for s in kept]
    for r, s in zip(read, kept):
        ids, mask = s.input_ids[: SETTINGS.max_length], s.loss_mask[: SETTINGS.max_length]
        assert torch.equal(r["input_ids"], ids) and torch.equal(r["loss_mask"], mask)
        direct = fx(ids[None])  # alone, unpadded: the cache's batching must not change anything
        assert r["aux"].dtype == torch.bfloat16 and r["aux"].shape == (len(ids), 3 * 64)
        torch.testing.assert_close(r["aux"].float(), direct.aux[0], rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(r["last"].float(), direct.last[0], rtol=1.6e-2, atol=1e-2)
        logits = direct.last[0] @ tiny_target.lm_head.weight.T  # the teacher summary, from fp32 states
        assert torch.equal(r["teacher_top1"].long(), logits.argmax(-1))
        torch.testing.assert_close(r["teacher_lse"], torch.logsumexp(logits, -1), rtol=1e-4, atol=1e-4)
    on_disk = sum((out / "shards" / f).stat().st_size for f in _files(out) if f.endswith(".safetensors"))
    assert result.bytes_written == on_disk
    assert on_disk / result.tokens_computed == pytest.approx(manifest["bytes_per_token"], rel=0.2)
    width = max(len(r["input_ids"]) for r in read[:4])
    aux, mask = pad_right([r["aux"] for r in read[:4]]), pad_right([r["loss_mask"] for r in read[:4]])
    assert aux.shape == (4, width, 192) and aux.dtype == torch.bfloat16 and mask.dtype == torch.bool
    assert int(mask.sum()) == sum(int(r["loss_mask"].sum()) for r in read[:4])
    torch.testing.assert_close(aux[0, : len(read[0]["aux"])], read[0]["aux"], rtol=0, atol=0)
    assert not aux[0, len(read[0]["aux"]):].any()  # zeros after the row


@pytest.mark.slow
def test_interrupted_build_resumes_to_the_same_bytes(reference_cache, tmp_path, tiny_target, smollm2_tokenizer):  # noqa: F811
    ref, _ = reference_cache
    out = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        _build(Interrupted(_samples(), stop=20), tiny_target, smollm2_tokenizer, out)
    done = [p for p in (out / "shards").glob("*.json")]
    assert 0 < len(done) < len(_files(ref)) // 2
    with pytest.raises(LyannaError, match="incomplete"):
        FeatureCache(out)
    # a shard file cut short (e.g. the disk filled up) is noticed too
    victim = shard_path(out, 0)
    victim.write_bytes(victim.read_bytes()[:1000])
    result, said = _build(_samples(), tiny_target, smollm2_tokenizer, out)
    assert "shard 0: size" in said and result.shards_reused == len(done) - 1
    assert _files(out) == _files(ref)
    assert json.loads((out / "manifest.json").read_text()) == json.loads((ref / "manifest.json").read_text())
    again, _ = _build(_samples(), tiny_target, smollm2_tokenizer, out)
    assert again.shards_written == 0 and again.shards_reused == again.shards_total


def test_corrupted_shard_is_refused_then_regenerated(reference_cache, tmp_path, tiny_target, smollm2_tokenizer):  # noqa: F811
    ref, _ = reference_cache
    out = tmp_path / "cache"
    _build(_samples(), tiny_target, smollm2_tokenizer, out)
    victim = shard_path(out, 2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte in the features
    victim.write_bytes(bytes(data))
    cache = FeatureCache(out)  # opening checks sizes only ...
    with pytest.raises(LyannaError, match="shard 2: checksum mismatch"):
        cache.verify()
    with pytest.raises(LyannaError, match="shard 2: checksum mismatch"):
        list(cache.iter_samples())  # ... and every shard is checked as it is read
    result, said = _build(_samples(), tiny_target, smollm2_tokenizer, out)
    assert "shard 2: checksum mismatch" in said and result.shards_written == 1
    assert _files(out) == _files(ref)
    FeatureCache(out).verify()


@pytest.mark.slow
def test_other_target_or_tokenizer_is_refused(reference_cache, tmp_path, other_target_dir, header_template_dir,  # noqa: F811
                                              tiny_target, smollm2_tokenizer):
    from transformers import AutoTokenizer

    ref, _ = reference_cache
    other_model = load_target_model(str(other_target_dir))
    other_tok = AutoTokenizer.from_pretrained(header_template_dir)
    other_tok.add_tokens(["<brand-new-token>"])
    with pytest.raises(LyannaError, match="made with target sha256:") as err:
        FeatureCache(ref, target_fingerprint=target_fingerprint(other_model))
    assert "\n" not in str(err.value)
    with pytest.raises(LyannaError, match="made with tokenizer"):
        FeatureCache(ref, tokenizer_fingerprint=tokenizer_fingerprint(other_tok))
    with pytest.raises(LyannaError, match="made with layer ids"):
        FeatureCache(ref, layer_ids=(1, 2, 0))
    # nor may a build add shards from another target (or tokenizer) to an existing cache
    out = tmp_path / "cache"
    _build(_samples()[:10], other_model, smollm2_tokenizer, out)
    with pytest.raises(LyannaError, match="other target"):
        _build(_samples()[:10], tiny_target, smollm2_tokenizer, out)
    with pytest.raises(LyannaError, match="other tokenizer"):
        _build(_samples()[:10], other_model, other_tok, out)


def test_shard_processes_cover_every_sample_once(reference_cache, tmp_path, tiny_target, smollm2_tokenizer):  # noqa: F811
    ref, _ = reference_cache
    out = tmp_path / "cache"
    results = []
    for part in range(3):
        if part:
            with pytest.raises(LyannaError, match="incomplete"):
                FeatureCache(out)
        results.append(_build(_samples(), tiny_target, smollm2_tokenizer, out, shard=(part, 3))[0])
    assert [r.complete for r in results] == [False, False, True]
    assert sum(r.shards_written for r in results) == results[0].shards_total
    assert _files(out) == _files(ref)  # the split changes who computes a shard, not its bytes
    indexes = [r["index"] for r in FeatureCache(out).iter_samples()]
    kept = [s.index for s in _samples() if s.loss_mask[: SETTINGS.max_length].any()]
    assert sorted(indexes) == kept



def test_bad_inputs_are_refused(tmp_path, tiny_target, smollm2_tokenizer):  # noqa: F811
    with pytest.raises(TypeError, match="re-iterable"):
        _build(iter(_samples()), tiny_target, smollm2_tokenizer, tmp_path / "a")
    long = Sample(7, torch.arange(3, 3 + SETTINGS.max_length + 1), torch.ones(SETTINGS.max_length + 1, dtype=torch.bool))
    with pytest.raises(LyannaError, match="sample 7 has 41 tokens, more than max_length 40"):
        _build([long], tiny_target, smollm2_tokenizer, tmp_path / "b")  # samples are cut once, when built
    with pytest.raises(LyannaError, match="--shard"):
        _build(_samples(), tiny_target, smollm2_tokenizer, tmp_path / "b", shard=(3, 3))
    with pytest.raises(LyannaError, match="no sample has any loss token"):
        _build([Sample(0, torch.arange(5), torch.zeros(5, dtype=torch.bool))], tiny_target, smollm2_tokenizer,
               tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(LyannaError, match="not a feature cache"):
        _build(_samples(), tiny_target, smollm2_tokenizer, tmp_path / "d")

    class Drifting:  # a sample stream that is not the same twice
        reads = 0

        def __iter__(self):
            Drifting.reads += 1
            samples = _samples()
            samples[0].input_ids[0] = Drifting.reads % 200 + 3
            return iter(samples)

    with pytest.raises(LyannaError, match="samples changed"):
        _build(Drifting(), tiny_target, smollm2_tokenizer, tmp_path / "e")
    with pytest.raises(LyannaError, match="is not a feature cache"):
        FeatureCache(tmp_path / "d")


@pytest.mark.slow
def test_cli_builds_resumes_and_reports_user_errors(tmp_path, tiny_llama_smollm2_vocab, smollm2_tokenizer,
                                                    sharegpt_records, capsys):
    import importlib.util
    import itertools
    from pathlib import Path

    from lyanna_train.data.corpus import Corpus
    from lyanna_train.data.samples import SampleSettings, iter_samples

    from ..conftest import write_jsonl

    script = Path(__file__).resolve().parents[2] / "data_tools" / "build_feature_cache.py"
    spec = importlib.util.spec_from_file_location("build_feature_cache", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    target = tmp_path / "target"
    tiny_llama_smollm2_vocab.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    corpus = write_jsonl(tmp_path / "chats.jsonl", sharegpt_records[:8])
    args = ["--corpus", str(corpus), "--target", str(target), "--out", str(tmp_path / "cache"), "--layers", "0",
            "--max-samples", "6", "--max-length", "64", "--shard-tokens", "100", "--no-progress"]
    assert cli.main(args) == 0
    cache = FeatureCache(tmp_path / "cache", target_fingerprint(tiny_llama_smollm2_vocab),
                         tokenizer_fingerprint(smollm2_tokenizer), [0])
    expected = list(itertools.islice(iter_samples(Corpus.resolve([str(corpus)]), smollm2_tokenizer,
                                                  SampleSettings(max_length=64)), 6))
    assert cache.num_samples == len(expected) >= 4 and cache.manifest["source"]["max_samples"] == 6
    read = list(cache.iter_samples())
    assert [r["index"] for r in read] == [s.index for s in expected]
    assert all(torch.equal(r["input_ids"], s.input_ids) for r, s in zip(read, expected))
    assert cli.main(args) == 0 and "nothing to compute" in capsys.readouterr().out
    assert cli.main(args[:-7] + ["--layers", "1", "--no-progress"]) == 2
    assert "out of range" in capsys.readouterr().err


FP8 = CacheSettings(max_length=40, shard_tokens=150, batch_tokens=96, feature_dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory, tiny_target, smollm2_tokenizer):  # noqa: F811
    out = tmp_path_factory.mktemp("cache") / "fp8"
    result, _ = _build(_samples(), tiny_target, smollm2_tokenizer, out, settings=FP8)
    return out, result


def _shard_bytes(root) -> int:
    return sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors"))


@pytest.mark.slow
def test_fp8_cache_round_trip_and_half_the_bytes(reference_cache, fp8_cache, tiny_target, smollm2_tokenizer):  # noqa: F811
    """The same samples as the bf16 cache, read back within e4m3's rounding, in about half the
    bytes per token (measured from the files)."""
    (ref, ref_result), (out, result) = reference_cache, fp8_cache
    cache = FeatureCache(out, target_fingerprint(tiny_target), tokenizer_fingerprint(smollm2_tokenizer), LAYERS,
                         feature_dtype="float8_e4m3fn")
    assert cache.manifest["dtype"] == "float8_e4m3fn" and "per token" in cache.manifest["scale"]
    fx = FeatureExtractor(tiny_target, LAYERS)
    bf16 = list(FeatureCache(ref).iter_samples())
    for r, b in zip(cache.iter_samples(), bf16):
        assert r["index"] == b["index"] and torch.equal(r["input_ids"], b["input_ids"])
        assert torch.equal(r["teacher_top1"], b["teacher_top1"]) and torch.equal(r["loss_mask"], b["loss_mask"])
        direct = fx(r["input_ids"][None])
        for key in ("aux", "last"):
            assert r[key].dtype == torch.bfloat16  # decoded: training reads what it always read
            exact = getattr(direct, key)[0]
            # every value within e4m3's half-spacing (2^-4 relative) plus the bf16 read-back
            torch.testing.assert_close(r[key].float(), exact, rtol=2 ** -4 + 2 ** -8, atol=1e-4)
            rel = (r[key].float() - exact).norm(dim=-1) / exact.norm(dim=-1)
            assert float(rel.mean()) < 0.03  # against bf16's ~0.002: e4m3's 3 mantissa bits
    measured, measured_bf16 = _shard_bytes(out) / result.tokens_computed, _shard_bytes(ref) / ref_result.tokens_computed
    assert result.bytes_written == _shard_bytes(out)
    # aux + last: 256 values of 2 bytes -> 1 byte, plus 4 fp32 scales and the 13 bytes of ids,
    # mask and teacher summary per token (a 576-wide target: 2,333 against 4,621 bytes)
    assert cache.manifest["bytes_per_token"] == 256 + 16 + 13 and FeatureCache(ref).manifest["bytes_per_token"] == 525
    assert measured == pytest.approx(285, rel=0.1) and measured / measured_bf16 < 0.56
    from lyanna_train.data.feature_cache import bytes_per_token

    assert bytes_per_token(3 * 576, 576, "float8_e4m3fn") / bytes_per_token(3 * 576, 576) == pytest.approx(0.505, abs=1e-3)


def test_fp8_shards_are_checksummed(fp8_cache, tmp_path, tiny_target, smollm2_tokenizer):  # noqa: F811
    ref, _ = fp8_cache
    out = tmp_path / "fp8"
    _build(_samples(), tiny_target, smollm2_tokenizer, out, settings=FP8)
    assert _files(out) == _files(ref)  # deterministic, as bf16 is
    victim = shard_path(out, 1)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one fp8 value
    victim.write_bytes(bytes(data))
    with pytest.raises(LyannaError, match="shard 1: checksum mismatch"):
        list(FeatureCache(out).iter_samples())
    result, said = _build(_samples(), tiny_target, smollm2_tokenizer, out, settings=FP8)
    assert "shard 1: checksum mismatch" in said and result.shards_written == 1
    assert _files(out) == _files(ref)


def test_a_cache_of_one_feature_dtype_is_refused_for_another(reference_cache, fp8_cache, tiny_target,  # noqa: F811
                                                             smollm2_tokenizer):
    (bf16, _), (fp8, _) = reference_cache, fp8_cache
    with pytest.raises(LyannaError, match="made with feature dtype float8_e4m3fn, not bfloat16") as err:
        FeatureCache(fp8, feature_dtype="bfloat16")
    assert "\n" not in str(err.value)
    with pytest.raises(LyannaError, match="made with feature dtype bfloat16, not float8_e4m3fn"):
        FeatureCache(bf16, feature_dtype="float8_e4m3fn")
    with pytest.raises(LyannaError, match="made with other dtype"):  # nor may a build add to it in the other dtype
        _build(_samples(), tiny_target, smollm2_tokenizer, fp8, settings=SETTINGS)
    with pytest.raises(LyannaError, match="unknown feature dtype 'fp4'"):
        CacheSettings(feature_dtype="fp4")
