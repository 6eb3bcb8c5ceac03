"""lyanna-generate and lyanna-bench on a tiny random Llama with a tiny byte-level tokenizer,
the decode presets, and the benchmark's records, summary and lossless check. The exported
draft is fitted to the target's own answers to the test prompts, so the lossless checks
cover draft tokens that were verified and kept."""

from __future__ import annotations

import copy
import io
import json
import re

import pytest
import torch

from lyanna_train.cli.bench import main as bench_main
from lyanna_train.runtime.settings import load_decode_settings
from lyanna_train.cli.generate import RunStreamer, main as generate_main
from lyanna_train.errors import LyannaError
from lyanna_train.evaluation import benchmark as B
from lyanna_train.evaluation.prompts import Question, read_questions, render_prompt
from lyanna_train.runtime.scheduling.requests import Request, Status
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, SamplingParams, TreeShape
from ..tiny_models import H, byte_level_tokenizer, tiny_llama  # H: also test_batched_bench's

QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["Write about tea.", "Now shorter."]},
             {"question_id": 2, "category": "coding", "turns": ["def fib(n):", "Add a docstring."]}]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_llama(tokenizer)


def greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def bench_conversations(target, tokenizer, answer_tokens: int, follow: int) -> list[list[int]]:
    """Every prompt ``run_question`` builds for QUESTIONS (second turns after the target's
    ``answer_tokens``-token answers), each followed by the target's next ``follow`` tokens."""
    out = []
    for q in QUESTIONS:
        messages = []
        for text in q["turns"]:
            messages.append({"role": "user", "content": text})
            prompt = render_prompt(tokenizer, messages)
            out.append(prompt + greedy(target, prompt, follow))
            answer = out[-1][len(prompt):len(prompt) + answer_tokens]
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return out


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, target, tokenizer):
    """The target + tokenizer saved as a local directory, and a draft exported for it,
    fitted (:func:`tests.conftest.fit_draft`) to the target's answers in the conversations
    the tests below decode (answers of 8, 12 and 24 tokens), so its candidates are accepted."""
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.models.config import DraftConfig
    from lyanna_train.models.draft_head import DraftHead
    from lyanna_train.training.checkpoint import write_draft_weights

    from ..conftest import fit_draft

    root = tmp_path_factory.mktemp("generate-bench")
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    with torch.inference_mode():
        fulls = bench_conversations(target, tokenizer, 12, 32) + bench_conversations(target, tokenizer, 8, 32)
    seen = sorted({t for full in fulls for t in full})
    torch.manual_seed(1)
    hot = seen + [t for t in torch.randperm(len(tokenizer)).tolist() if t not in set(seen)][:max(0, 48 - len(seen))]
    cfg = DraftConfig(target_hidden_size=H, vocab_size=len(tokenizer), draft_vocab_size=len(hot), hidden_size=H,
                      intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      aux_layer_ids=(0, 1, 2), pool_size=128, pool_threshold=0.0)
    draft = DraftHead(cfg, torch.tensor(hot), target.model.embed_tokens.weight)
    draft = fit_draft(target, draft, fulls, steps=400, lr=1e-2, threads=1)
    ckpt = root / "run" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    write_draft_weights(ckpt, draft, {"layer_ids": [0, 1, 2], "target": str(root / "target")})
    export_checkpoint(root / "run", root / "export", target=target, tokenizer=tokenizer, say=lambda *_: None)
    return root / "export"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def records(target, tokenizer, export_dir):
    from lyanna_train.export.reader import load_exported

    draft, _ = load_exported(export_dir, target, tokenizer)
    methods = B.make_methods(["target", "pld", "lyanna", "lookup"], target, draft, load_decode_settings("default"))
    out: dict = {m: [] for m in methods}
    questions = [Question(d["question_id"], d["category"], tuple(d["turns"])) for d in QUESTIONS]
    for i, q in enumerate(questions):
        for m, rec in B.run_question(q, methods, tokenizer, 12, turns=2, rotate=i).items():
            out[m].append(rec)
    return out


def test_decode_presets_and_overrides():
    default = load_decode_settings("default")
    assert (default.tree.depth, default.tree.branch, default.tree.beam, default.tree.max_nodes) == (1, 3, 1, 6)
    assert default.verify == "auto" and load_decode_settings("chain").verify == "all"
    assert (default.lookup.max_tokens, default.lookup.max_ngram, default.lookup.branches) == (10, 3, 1)
    assert default.lookup.pool_tokens == 10 and load_decode_settings("chain").lookup.pool_tokens == 0
    assert default.sampling.greedy and default.sampling.top_p == 1.0 and default.seed == 0
    chain = load_decode_settings("chain")
    assert (chain.tree.branch, chain.tree.beam, chain.tree.max_nodes, chain.lookup.max_tokens) == (1, 1, 5, 0)
    lookup = load_decode_settings("lookup_only")
    assert lookup.tree.depth == 0 and lookup.lookup.max_tokens > 0
    tuned = load_decode_settings("default", ["tree.depth=6", "sampling.temperature=0.7", "seed=3"])
    assert isinstance(tuned, DecodeSettings) and tuned.tree.depth == 6 and tuned.sampling.temperature == 0.7
    assert tuned.seed == 3 and tuned.tree.branch == 3
    with pytest.raises(LyannaError, match="unknown decode setting 'tree.dept'"):
        load_decode_settings("default", ["tree.dept=6"])
    with pytest.raises(LyannaError, match="tree.depth"):
        load_decode_settings("default", ["tree.depth=many"])
    with pytest.raises(LyannaError, match=r"tree\.depth = -1 is not allowed \(allowed: an integer >= 0\)"):
        load_decode_settings("default", ["tree.depth=-1"])
    with pytest.raises(LyannaError, match="unknown decode preset 'nope'.*chain, default, lookup_only"):
        load_decode_settings("nope")


def test_default_preset_is_the_dataclass_defaults_and_the_others_state_their_changes(tmp_path):
    """Each field is declared once, in the dataclasses: default.yaml adds nothing, and an empty
    or comment-only preset file loads to the defaults."""
    assert load_decode_settings("default") == DecodeSettings()
    for text in ("", "{}\n", "# only a comment\n"):
        (tmp_path / "empty.yaml").write_text(text)
        assert load_decode_settings(str(tmp_path / "empty.yaml")) == DecodeSettings()
    assert load_decode_settings("chain") == DecodeSettings(tree=TreeShape(depth=5, branch=1, beam=1, max_nodes=5),
                                                           lookup=LookupSettings(max_tokens=0, pool_tokens=0),
                                                           verify="all")
    assert load_decode_settings("lookup_only") == DecodeSettings(tree=TreeShape(depth=0, max_nodes=0),
                                                                 lookup=LookupSettings(max_tokens=10, pool_tokens=0))


def test_read_questions_accepts_every_prompt_form_and_names_a_bad_line(tmp_path):
    mtbench = read_questions("mtbench")
    assert len(mtbench) == 80 and all(len(q.turns) == 2 for q in mtbench) and mtbench[0].category == "writing"
    humaneval = read_questions("humaneval", limit=3)
    assert len(humaneval) == 3 and humaneval[0].question_id == "HumanEval/0"
    spread = read_questions("mtbench", limit=8)  # every category, not the first eight writing prompts
    assert len({q.category for q in spread}) == 8
    few = read_questions("mtbench", limit=6, categories=("writing", "roleplay", "humanities"))
    assert [q.category for q in few] == ["writing"] * 2 + ["roleplay"] * 2 + ["humanities"] * 2
    with pytest.raises(LyannaError, match=r"no questions in categories \['poetry'\]"):
        read_questions("mtbench", categories=("poetry",))
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"turns": ["a", "b"]}\n\n{"prompt": "c"}\n{"text": "d", "category": "x"}\n{"instruction": "e"}\n')
    assert [q.turns for q in read_questions(str(path))] == [("a", "b"), ("c",), ("d",), ("e",)]
    assert read_questions(str(path))[2].category == "x"
    txt = tmp_path / "p.txt"
    txt.write_text("first\nprompt\n\n\nsecond\n")
    assert [q.turns for q in read_questions(str(txt))] == [("first\nprompt",), ("second",)]
    for bad in ('{"turns": ["a"]}\n{"prompt": "cut', '{"turns": ["a"]}\n{"answer": "no prompt"}', '{"turns": ["a"]}\n[1, 2]', '{"turns": ["a"]}\n{"turns": [3]}'):
        path.write_text(bad)
        with pytest.raises(LyannaError, match=rf"{path}:2: "):
            read_questions(str(path))


@pytest.mark.slow
def test_records_follow_spec_bench_and_summary_has_every_figure(records, tokenizer):
    assert set(records) == {"target", "pld", "lyanna", "lookup"}
    for method, recs in records.items():
        assert [r["question_id"] for r in recs] == [1, 2] and [r["category"] for r in recs] == ["writing", "coding"]
        for r in recs:
            c = r["choices"][0]
            assert r["model_id"] == method and len(c["turns"]) == len(c["new_tokens"]) == len(c["wall_time"]) == 2
            assert c["new_tokens"] == [len(ids) for ids in c["token_ids"]] == [12, 12]
            assert c["turns"] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in c["token_ids"]]
            assert sum(c["decoding_steps"]) == len(c["accept_lengths"]) + 2  # one prefill per turn
            assert len(c["tree_sizes"]) == len(c["accept_lengths"]) and all(w > 0 for w in c["wall_time"])
    summary = B.summarize(records)
    target = summary["target"]
    assert target["speedup"] == 1.0 and target["tau"] == 1.0 and target["mean_tree_size"] == 1.0
    lyanna = summary["lyanna"]
    assert lyanna["prompts"] == 4 and lyanna["new_tokens"] == 48 and lyanna["mean_tree_size"] > 1
    assert lyanna["tau"] == pytest.approx(48 / lyanna["target_forwards"])
    assert lyanna["speedup"] == pytest.approx(lyanna["tokens_per_s"] / target["tokens_per_s"])
    rates = lyanna["accept_rate"]
    assert len(rates) >= 5 and all(a >= b for a, b in zip(rates, rates[1:])) and 0 <= rates[0] <= 1
    assert B.lossless_report(records)["identical"]
    assert B.lossless_lines(B.lossless_report(records)) == ["lossless: yes (4/4 prompts identical)"]
    # the verdict covers draft nodes: most verifies kept at least one candidate, more than lookup alone did
    assert rates[0] > 0.5 and lyanna["tau"] > summary["lookup"]["tau"], (rates, lyanna["tau"])


@pytest.mark.slow
def test_lossless_check_detects_a_corrupted_output(records):
    bad = copy.deepcopy(records)
    ids = bad["lyanna"][1]["choices"][0]["token_ids"][1]
    ids[5] = (ids[5] + 1) % 300
    del bad["pld"][0]["choices"][0]["token_ids"][0][-3:]
    report = B.lossless_report(bad)
    assert not report["identical"] and report["methods"]["lookup"]["mismatches"] == 0
    assert report["methods"]["lyanna"] == {"mismatches": 1, "first": {"question_id": 2, "turn": 2, "position": 5,
                                                                      "lengths": [12, 12]}, "verdict": True}
    assert report["methods"]["pld"]["first"]["position"] == 9
    lines = B.lossless_lines(report)
    assert lines[0] == "lossless: NO" and any("lyanna: 1/4 prompts differ" in x and "token 5" in x for x in lines)
    assert not B.lossless_report({"lyanna": records["lyanna"]})["checked"]


@pytest.mark.slow
def test_stock_linears_are_reported_but_not_judged(records):
    """``stock`` is the same target with torch's own GEMM forms: float noise, not a bug."""
    with_stock = copy.deepcopy(records)
    with_stock["stock"] = copy.deepcopy(records["target"])
    assert B.lossless_lines(B.lossless_report(with_stock)) == ["lossless: yes (4/4 prompts identical)"]
    with_stock["stock"][0]["choices"][0]["token_ids"][0][3] += 1
    report = B.lossless_report(with_stock)
    assert report["identical"] and report["methods"]["stock"]["mismatches"] == 1
    lines = B.lossless_lines(report)
    assert lines[0] == "lossless: yes (4/4 prompts identical)" and "stock: 3/4 prompts identical" in lines[1]


@pytest.mark.slow
def test_bench_cli_writes_results_and_exit_status(tmp_path, export_dir, prompts_file, capsys, monkeypatch):
    argv = ["--draft", str(export_dir), "--prompts", str(prompts_file), "--max-new-tokens", "8", "--threads", "1",
            "--methods", "target,stock,pld,lyanna,lookup", "--out", str(tmp_path / "out")]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "| method | new tokens | tok/s | speedup |" in out and "lossless: yes (4/4 prompts identical)" in out
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files == {"target.jsonl", "stock.jsonl", "pld.jsonl", "lyanna.jsonl", "lookup.jsonl", "summary.json", "summary.md",
                     "bench.png"}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["lossless"]["identical"] and summary["methods"]["target"]["speedup"] == 1.0
    assert summary["decode"]["tree"]["depth"] == 1 and summary["environment"]["threads"] == 1
    assert len((tmp_path / "out" / "lyanna.jsonl").read_text().splitlines()) == 2

    real = B.runtime_method

    def corrupted(target, draft, settings, cost=None):  # the lyanna runs emit a wrong first token
        method = real(target, draft, settings, cost)

        def run(prompt, max_new_tokens):
            r = method(prompt, max_new_tokens)
            r.tokens[0] += 1
            return r

        return run

    seen = []

    def recorded(target, draft, settings, cost=None):
        seen.append(settings.lookup)
        return real(target, draft, settings, cost)

    monkeypatch.setattr(B, "runtime_method", recorded)  # head: the same draft, lookup and pool candidates off
    assert bench_main(argv[:-4] + ["--methods", "target,lyanna,head", "--turns", "1", "--out", str(tmp_path / "head")]) == 0
    assert seen[0].max_tokens > 0 and seen[0].pool_tokens > 0 and seen[1].max_tokens == seen[1].pool_tokens == 0
    assert "lossless: yes" in capsys.readouterr().out

    monkeypatch.setattr(B, "runtime_method", corrupted)
    assert bench_main(argv[:-1] + [str(tmp_path / "bad")] + ["--turns", "1", "--methods", "target,lyanna"]) == 1
    out = capsys.readouterr().out
    assert "lossless: NO" in out and "lyanna: 2/2 prompts differ from target" in out and "at token 0" in out


@pytest.mark.parametrize("cli", [bench_main, generate_main])
@pytest.mark.parametrize("case", ["missing-draft", "bad-jsonl", "unknown-setting"])
def test_bad_input_is_one_line_and_exit_2(cli, case, tmp_path, export_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["cut\n')
    prompt_flag = "--prompts" if cli is bench_main else "--file"
    argv = {"missing-draft": ["--draft", str(tmp_path / "nope"), prompt_flag, str(bad.with_name("x.jsonl"))],
            "bad-jsonl": ["--draft", str(export_dir), prompt_flag, str(bad)],
            "unknown-setting": ["--draft", str(export_dir), "--set", "tree.width=3", prompt_flag, str(bad)]}[case]
    if case == "missing-draft":
        bad.with_name("x.jsonl").write_text('{"prompt": "hi"}\n')
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0]
    assert {"missing-draft": "not found", "bad-jsonl": f"{bad}:2:", "unknown-setting": "tree.width"}[case] in err[0]


@pytest.mark.parametrize("source", ["argument", "stdin"])
def test_generate_streams_exactly_the_decoded_tokens(source, export_dir, target, tokenizer, capsys, monkeypatch):
    # every candidate verified (no timing-dependent choice): the stream carries accepted draft tokens
    argv = ["--draft", str(export_dir), "--max-new-tokens", "24", "--threads", "1", "--set", "verify=all"]
    if source == "stdin":
        monkeypatch.setattr("sys.stdin", io.StringIO("Write about tea.\n"))
    else:
        argv.append("Write about tea.")
    assert generate_main(argv) == 0
    captured = capsys.readouterr()
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Write about tea."}])
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert captured.out == tokenizer.decode(ref[0, len(prompt):], skip_special_tokens=True) + "\n"
    assert "24 new tokens" in captured.err and "tok/s" in captured.err
    assert float(re.search(r"τ (\d+\.\d+)", captured.err).group(1)) > 1.3, captured.err


@pytest.mark.parametrize("mark", [None, "brackets"])
def test_streamer_never_prints_half_a_character(tokenizer, mark):
    text = "naïve café 🚀 東京 ok\ndef add(a, b):\n    return a + b\n"
    ids = tokenizer(text)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # multi-byte characters are split over tokens
    out = io.StringIO()
    streamer = RunStreamer(tokenizer, out, mark)
    seen = []
    for i in range(0, len(ids), 2):  # two tokens per "iteration"
        streamer.put_tokens(ids[i:i + 2])
        seen.append(out.getvalue())
    streamer.end()
    assert not any("\ufffd" in s for s in seen)
    printed = out.getvalue()
    if mark == "brackets":
        assert printed.startswith("[") and "]" in printed
        printed = printed.replace("[", "").replace("]", "")
    assert printed == text + "\n"


def test_summary_line_reports_speed_tau_and_histogram():
    from lyanna_train.cli.generate import summary_line

    result = Request(1, [1], 10, SamplingParams(), 0, frozenset(), tokens=list(range(10)), accept_lengths=[1, 3, 3, 2],
                     target_forwards=5)
    result.finished_at = result.submitted_at + 2.0
    result.status = Status.FINISHED
    line = summary_line(result)
    assert "10 new tokens" in line and "5.0 tok/s" in line and "τ 2.00" in line and "0:1 1:1 2:2" in line


@pytest.mark.slow
def test_bench_on_smollm2_is_lossless_with_accepted_draft_tokens(tmp_path, smollm2_fitted, smollm2_tokenizer, capsys,
                                                                 monkeypatch):
    """The CLI end to end on the real target, with a head whose draft tokens are accepted
    (``smollm2_fitted``) on the prompts it was fitted to: the lossless verdict covers
    verified and kept draft nodes."""
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.runtime.cpu import tuning
    from lyanna_train.runtime.pricing.cost import Costs

    # the chain preset verifies every draft node whatever the costs: the CPU tuning (~40 s on a
    # fresh machine, test_cpu_tuning.py checks it) would decide nothing here
    monkeypatch.setattr(tuning, "tune", lambda *args, **kwargs: Costs.flat())
    from lyanna_train.training.checkpoint import write_draft_weights

    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    write_draft_weights(ckpt, smollm2_fitted.draft, {"target": "smollm2", "layer_ids": [1, 14, 26]})
    export_checkpoint(tmp_path / "run", tmp_path / "export", target=smollm2_fitted.target,
                      tokenizer=smollm2_tokenizer, say=lambda *_: None)
    prompts = tmp_path / "fitted.txt"
    prompts.write_text("\n\n".join(smollm2_tokenizer.decode(p) for p in smollm2_fitted.prompts) + "\n")
    argv = ["--draft", str(tmp_path / "export"), "--prompts", str(prompts), "--turns", "1", "--no-chat",
            "--max-new-tokens", "24", "--decode", "chain", "--methods", "target,lyanna", "--out", str(tmp_path / "bench")]
    assert bench_main(argv) == 0
    assert "lossless: yes (2/2 prompts identical)" in capsys.readouterr().out
    lyanna = json.loads((tmp_path / "bench" / "summary.json").read_text())["methods"]["lyanna"]
    assert lyanna["accept_rate"][0] > 0.5 and lyanna["tau"] > 2  # draft tokens verified and kept


def test_generate_budget_must_fit_the_context_and_a_turn_stops_at_its_end(export_dir, target, tokenizer, capsys):
    """Issue 24: --max-new-tokens 10**30 decoded for ever, and 700 decoded past the 512-position context."""
    context = target.config.max_position_embeddings
    base = ["--draft", str(export_dir), "--threads", "1"]
    assert generate_main([*base, "--max-new-tokens", str(10**30), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"lyanna-generate: error: --max-new-tokens {10**30} does not fit the target's context of "
                       f"{context} positions (at most {context - 1}, after a one-token prompt)")
    words = next(n for n in range(400, 0, -1)
                 if len(render_prompt(tokenizer, [{"role": "user", "content": "tea " * n}])) <= context - 20)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "tea " * words}])
    room = context - len(prompt)
    assert generate_main([*base, "--max-new-tokens", str(room + 50), "--set", "sampling.temperature=0",
                          "tea " * words]) == 0
    err = capsys.readouterr().err
    assert f"leave room for {room} of the {room + 50} --max-new-tokens" in err and f"{room} new tokens" in err


@pytest.mark.parametrize("depths", [1, 3, 5])
def test_every_bench_table_row_has_a_cell_under_every_heading(depths):
    """Each method and decoding renders as many cells as the header names, whatever depth
    each method measured (a depth-1 decoding once left the lyanna row short)."""
    from lyanna_train.evaluation.report import batch_table as batched_table
    from lyanna_train.evaluation.report import method_table as markdown_table

    def cells(line: str) -> int:
        return len(line.strip().strip("|").split("|"))

    figures = dict(new_tokens=10, tokens_per_s=5.0, tau=1.5, mean_tree_size=2.0)
    summary = {"target": {**figures, "speedup": 1.0, "accept_rate": []},
               "stock": {**figures, "speedup": 0.5, "accept_rate": []},
               "lyanna": {**figures, "speedup": 1.6, "accept_rate": [0.4]},  # a depth-1 decoding
               "head": {**figures, "speedup": 1.2, "accept_rate": [0.3, 0.1, 0.05, 0.01, 0.0, 0.0]},
               "lookup": {**figures, "speedup": None, "accept_rate": [0.2, 0.1]}}
    lossless = {"checked": True, "prompts": 2, "methods": {"lyanna": {"mismatches": 0}, "head": {"mismatches": 1}}}
    lines = markdown_table(summary, lossless, depths).splitlines()
    assert len(lines) == 2 + len(summary) and {cells(line) for line in lines} == {6 + depths + 1}
    row = dict(requests=2, new_tokens=10, tokens_per_s=5.0, vs_target=1.0, tokens_per_cpu_s=2.0, vs_target_cpu=None,
               latency_mean=1.0, latency_p50=1.0, latency_p95=2.0, tau=1.2, mean_tree_size=1.5)
    results = {1: {"target": row, "lyanna": {**row, "identical": 2}}, 4: {"plain": {**row, "vs_target": None}}}
    lines = batched_table(results).splitlines()
    assert {cells(line) for line in lines} == {cells(lines[0])} and len(lines) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_served_target_and_draft_decode_on_the_gpu(tmp_path, target, tokenizer):
    """With CUDA the CLIs' target goes to the GPU and the draft follows it; the tuning times the
    GPU's work, and greedy decoding there is the target's own."""
    from lyanna_train.runtime.cpu.tuning import tune
    from lyanna_train.runtime.scheduling.scheduler import generate
    from lyanna_train.runtime.served_models import load_models

    from ..tiny_models import export_random_draft

    on_gpu, _, draft = load_models(str(export_random_draft(tmp_path, target, tokenizer)), None)
    assert on_gpu.device.type == "cuda" and draft.fc.weight.device == on_gpu.device
    settings = load_decode_settings("default")
    cost = tune(on_gpu, draft, shape=settings.tree, cache=False)
    assert all(s > 0 for s in cost.verify.seconds)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Write about tea."}])
    ref = on_gpu.generate(torch.tensor([prompt], device=on_gpu.device), max_new_tokens=24, do_sample=False,
                          pad_token_id=0)
    assert generate(on_gpu, draft, prompt, 24, settings, cost=cost).tokens == ref[0, len(prompt):].tolist()
