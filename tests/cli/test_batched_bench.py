"""lyanna-bench --batch-size on a tiny random Llama: every method at every batch size, the
table, ratios, lossless check and plot; bad flags are one line; the pool-off head."""

from __future__ import annotations

import json
import time

import pytest

from lyanna_train.cli.bench import main as bench_main
from lyanna_train.errors import LyannaError
from lyanna_train.evaluation import batched as BB
from lyanna_train.evaluation import report as R
from lyanna_train.runtime.drafting.state import BatchDraftState
from lyanna_train.runtime.served_models import without_pool

from .test_generate_bench import H, QUESTIONS, export_dir, prompts_file, target, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def three_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "three.jsonl"
    extra = {"question_id": 3, "category": "math", "turns": ["What is 7 times 6?"]}
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS + [extra]), encoding="utf-8")
    return path


@pytest.mark.slow
def test_batched_bench_measures_every_method_at_every_size(tmp_path, export_dir, three_prompts, capsys):  # noqa: F811
    out = tmp_path / "out"
    argv = ["--draft", str(export_dir), "--prompts", str(three_prompts), "--num-prompts", "2", "--max-new-tokens", "8",
            "--threads", "1", "--batch-size", "1,3", "--hold", "2", "--out", str(out)]
    assert bench_main(argv) == 0
    printed = capsys.readouterr().out
    assert "| batch | method | requests | new tokens | tok/s | vs target | tok/CPU-s | vs target (CPU) | latency" in printed
    assert "batch 1: lyanna/target" in printed and "lyanna/best fixed" in printed and "lossless: yes" in printed
    assert {p.name for p in out.iterdir()} == {"summary.json", "summary.md", "batched.png"}
    summary = json.loads((out / "summary.json").read_text())
    results = summary["results"]
    assert set(results) == {"1", "3"}
    assert set(results["1"]) == set(results["3"]) == {"target", "plain", "lookup", "head", "pool-off", "lyanna",
                                                      "lyanna-hold2"}
    assert [results["1"]["lyanna"]["requests"], results["3"]["lyanna"]["requests"]] == [2, 3]  # max(N, B) prompts
    for rows in results.values():
        assert rows["target"]["vs_target"] == 1.0
        for name, s in rows.items():
            assert s["identical"] == s["requests"], name  # greedy: every method equals the target alone
            assert s["new_tokens"] == 8 * s["requests"]  # eos_token_id None: every request runs to its budget
            assert 0 < s["latency_p50"] <= s["latency_p95"] <= s["wall_time"] + 1e-6
            assert s["tau"] >= 1.0 and s["cpu_time"] > 0
    assert summary["decode"]["fusion"] == {"micro_batches": 1, "shallow_first": False, "prefill_tokens": 2048, "admit_wait": 4}


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size takes comma-separated integers of at least 1"),
    (["--batch-size", "1,x"], "--batch-size takes"),
    (["--batch-size", "4"], "batch size 4 needs 4 prompts"),
    (["--batch-size", "1", "--hold", "1"], "--hold takes comma-separated integers of at least 2"),
    (["--batch-size", "1", "--methods", "target,pld"], "bad methods ['target', 'pld'] for --batch-size"),
    (["--batch-size", "1", "--passes", "0"], "--passes must be at least 1, got 0"),
])
@pytest.mark.slow
def test_bad_batched_flags_are_one_line(flags, message, export_dir, prompts_file, capsys):  # noqa: F811
    assert bench_main(["--draft", str(export_dir), "--prompts", str(prompts_file)] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_the_pool_off_head_shares_the_layers_and_has_no_pool(target, export_dir, tokenizer):  # noqa: F811
    from lyanna_train.export.reader import load_exported

    draft, _ = load_exported(export_dir, target, tokenizer)
    bare = without_pool(draft)
    assert draft.gate is not None and bare.gate is None and bare.cfg.pool_size == 0 and draft.cfg.pool_size == 128
    assert bare.fc is draft.fc and bare.midlayer is draft.midlayer and bare.lm_head is draft.lm_head
    assert BatchDraftState(bare, 2).pool is None and BatchDraftState(draft, 2).pool is not None
    assert without_pool(bare) is bare


def test_percentile_is_numpys_linear_rule():
    import numpy as np

    values = [0.3, 5.0, 1.2, 2.2, 0.9, 7.5, 3.3]
    for q in (0, 50, 95, 100):
        assert BB.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert BB.percentile([2.0], 95) == 2.0


def test_passes_interleave_the_methods_and_report_each_ones_median_pass():
    """Three passes: the order rotates with the batch size and runs backwards every other
    pass; each summary is its method's median pass, every pass's tok/s beside it, and a
    pass that differs from the reference counts against the method."""
    calls, walls = [], {"a": [4.0, 1.0, 2.0], "b": [2.0, 2.0, 2.0], "c": [1.0, 8.0, 4.0]}

    def method(name):
        def run(prompts, max_new_tokens, batch):
            calls.append((batch, name))
            wall = walls[name][sum(1 for b, n in calls if n == name and b == batch) - 1]
            tokens = [[7] * max_new_tokens for _ in prompts]
            if name == "c" and len([1 for b, n in calls if n == "c" and b == batch]) == 2:
                tokens[0] = [8] * max_new_tokens  # one pass of c differs
            return BB.BatchRun(tokens, [wall] * len(prompts), wall, max_new_tokens * len(prompts), cpu_time=wall)
        return run

    methods = {n: method(n) for n in "abc"}
    results = BB.measure(methods, [[1], [2]], [1, 2], 4, 2, reference=lambda p: [7] * 4, passes=3)
    assert [n for b, n in calls if b == 1] == list("abc" "cba" "abc")
    assert [n for b, n in calls if b == 2] == list("bca" "acb" "bca")
    a = results[1]["a"]
    assert a["wall_time"] == 2.0 and a["tokens_per_s_passes"] == [2.0, 4.0, 8.0] and a["tokens_per_s"] == 4.0
    assert results[1]["c"]["identical"] == 1 and results[1]["a"]["identical"] == 2
    with pytest.raises(LyannaError, match="passes must be at least 1"):
        BB.measure(methods, [[1]], [1], 4, 1, passes=0)
    table = R.batch_table(results)
    assert "| 4.0 (2.0–8.0) |" in table


def test_each_timed_run_starts_after_the_previous_runs_cyclic_garbage_is_freed():
    """A run's decoder held in a reference cycle is freed before the next run starts, so no
    method pays for faulting in fresh pages because the one before it left memory behind."""
    import weakref

    left, seen = [], []

    class Decoder:  # a reference cycle: freed by the collector only
        def __init__(self):
            self.me = self

    def run(prompts, max_new_tokens, batch):
        seen.append([ref() is None for ref in left])
        decoder = Decoder()
        left.append(weakref.ref(decoder))
        return BB.BatchRun([[7] * max_new_tokens for _ in prompts], [1.0] * len(prompts), 1.0,
                           max_new_tokens * len(prompts), cpu_time=1.0)

    BB.measure({"a": run, "b": run}, [[1], [2]], [1], 4, 2, passes=2)
    assert len(seen) == 4 and all(all(freed) for freed in seen)


class _StepCounter:
    """A stand-in decoder: each request takes ``steps`` steps of ``seconds`` each."""

    def __init__(self, name, steps, seconds, log):
        from lyanna_train.runtime.scheduling.requests import Status

        self.name, self.steps, self.seconds, self.log, self.requests, self.status = name, steps, seconds, log, [], Status

    def submit(self, prompt, max_new_tokens):
        from types import SimpleNamespace

        request = SimpleNamespace(id=len(self.requests) + 1, tokens=[], status=self.status.WAITING, left=self.steps,
                                  target_forwards=0, accept_lengths=[], tree_sizes=[], error=None, done=False)
        self.requests.append(request)
        return request

    @property
    def idle(self):
        return all(r.done for r in self.requests)

    def step(self, closed=False):
        from types import SimpleNamespace

        self.log.append(self.name)
        time.sleep(self.seconds)
        request = next(r for r in self.requests if not r.done)  # one request at a time
        request.left -= 1
        request.tokens.append(7)
        request.done = request.left == 0
        if request.done:
            request.status = self.status.FINISHED
        return [SimpleNamespace(request=request, finished=request.done)]


def test_interleaved_steps_time_each_decoder_by_its_own_steps():
    """Decoders take their steps in turn until each is done; a method's wall time is the sum
    of its own steps (not the other's), a request's latency its decoder's own time when it
    finished."""
    log = []
    fast, slow = _StepCounter("fast", 2, 0.01, log), _StepCounter("slow", 3, 0.03, log)
    runs = BB.run_interleaved({"fast": fast, "slow": slow}, [[1], [2]], 4)
    assert log == ["fast", "slow"] * 4 + ["slow"] * 2  # in turn; the slow one goes on alone
    assert runs["fast"].tokens == [[7, 7], [7, 7]] and runs["slow"].tokens == [[7] * 3] * 2
    assert 0.04 <= runs["fast"].wall_time < 0.08 and 0.18 <= runs["slow"].wall_time < 0.3
    assert runs["fast"].latencies[0] == pytest.approx(runs["fast"].wall_time / 2, rel=0.3)
    assert runs["slow"].latencies[1] == runs["slow"].wall_time


@pytest.mark.slow
def test_batched_bench_can_interleave_the_decoders_steps(tmp_path, export_dir, three_prompts, capsys):  # noqa: F811
    """--interleave steps: target runs whole, our decoders step in turn; each of ours still
    equals the target alone, and the choice is written down."""
    out = tmp_path / "out"
    argv = ["--draft", str(export_dir), "--prompts", str(three_prompts), "--max-new-tokens", "8", "--threads", "1",
            "--batch-size", "2", "--num-prompts", "3", "--methods", "target,plain,lookup,lyanna", "--interleave", "steps", "--passes", "2",
            "--out", str(out)]
    assert bench_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interleave"] == "steps"
    for name, s in summary["results"]["2"].items():
        assert s["requests"] == 3 and 0 < s["latency_p50"] <= s["wall_time"] + 1e-6, name
        assert s["identical"] == 3 or name in BB.NUMERICS_ONLY, name  # target: left padding, reported not judged
    with pytest.raises(LyannaError, match="interleave is runs or steps"):
        BB.measure({}, [[1]], [1], 4, 1, interleave="turns")
