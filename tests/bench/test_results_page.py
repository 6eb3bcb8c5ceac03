"""bench/results/README.md is generated from the result files beside it: a stale page fails."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _page():
    return runpy.run_path(str(ROOT / "bench" / "results_page.py"), run_name="results_page")


def _rendered(tmp_path, folder: str, name: str, data: dict) -> str:
    """The page rendered from one result file, ``results/folder/name`` holding ``data``."""
    page = _page()
    (tmp_path / "results" / folder).mkdir(parents=True)
    (tmp_path / "results" / folder / name).write_text(json.dumps(data))
    page["render"].__globals__["RESULTS"] = tmp_path / "results"
    return page["render"]()


def test_results_page_matches_its_sources():
    page = _page()
    assert page["main"](["--check"]) == 0, "bench/results/README.md is stale: run python bench/results_page.py"


def test_every_figure_comes_from_a_result_file(tmp_path, monkeypatch):
    page = _page()
    folder = tmp_path / "results" / "serve-x"
    folder.mkdir(parents=True)
    level = {"server": "lyanna", "concurrency": 4, "requests": 8, "answered": 8, "tokens_per_s": 12.345,
             "tau": 1.5, "latency_p50": 0.5, "identical_to_no_draft": "8/8"}
    (folder / "serve_load.json").write_text(json.dumps({"command": "bench/serve_load.py --levels 4", "levels": [level]}))
    render = page["render"]
    render.__globals__["RESULTS"] = tmp_path / "results"
    text = render()
    assert "## `serve-x`" in text and "| lyanna | 4 | 8 | 8 | 12.3 | 1.500 | 0.500 | 8/8 |" in text
    level["tokens_per_s"] = 99.0  # a changed source changes the page
    (folder / "serve_load.json").write_text(json.dumps({"command": "x", "levels": [level]}))
    assert "| 99.0 |" in render()
    level["passes_tokens_per_s"] = [97.5, 99.0, 101.25]  # --repeats: every pass beside the median one
    (folder / "serve_load.json").write_text(json.dumps({"command": "x", "levels": [level]}))
    assert "tok/s (median pass)" in render() and "| 99.0 | 1.500 | 0.500 | 8/8 | 97.5 / 99.0 / 101.2 |" in render()


def test_the_regeneration_bench_has_its_table(tmp_path):
    data = {"command": "python bench/regeneration.py", "conversations": 4, "max_new_tokens": 8, "batch_sizes": [1],
            "results": {"generate": {"1": {"tokens": 32, "tokens_per_s": 10.0}},
                        "runtime": {"1": {"tokens": 32, "tokens_per_s": 21.5, "identical_to_generate": "4/4"}}},
            "feature_pass_tokens_per_s": 300.0, "runtime_vs_generate": 2.15, "runtime_vs_feature_pass": 0.07,
            "one_pass_vs_two": 1.62,
            "passes": {"batch_size": 1, "regenerate_by_batch": {"1": {"tokens_per_s": 5.3}, "2": {"tokens_per_s": 4.9}},
                       "two_pass": {"seconds": 8.1, "regenerate_seconds": 6.0, "features_seconds": 2.1},
                       "one_pass": {"seconds": 5.0, "samples": 4, "recomputed_samples": 1,
                                    "left_for_the_trainer_to_compute": 0}}}
    text = _rendered(tmp_path, "regen-x", "regeneration.json", data)
    assert "## `regen-x`" in text and "| runtime | 1 | 32 | 21.5 | 4/4 |" in text and "generate 2.15x" in text
    assert "one pass 5.0 s: 1.62x" in text and "1/4 samples re-tokenized otherwise" in text
    assert "by batch size: 1: 5.3 tok/s, 2: 4.9 tok/s" in text


def test_the_feature_storage_bench_has_its_table(tmp_path):
    run = {"variant": "fp8", "seed": 0, "bytes_per_token": 2333.07, "tau": 1.386, "heldout_top1_step0": 0.3659,
           "heldout_top1_step0_on_bf16": 0.366, "steps": 870, "minutes_to_last_step": 28.8, "minutes": 30.6}
    data = {"command": "python bench/feature_storage.py --variants bf16,fp8", "samples": 587, "summary": [], "runs": [run]}
    text = _rendered(tmp_path, "fp8-x", "summary.json", data)
    assert "## `fp8-x`" in text and "587 samples per run" in text
    assert "| fp8 | 0 | 2333.1 | 1.386 | 0.366 | 0.366 | 870 | 28.8 | 30.6 |" in text


def test_the_regenerated_data_bench_has_its_table(tmp_path):
    head = {"samples": 218, "loss_tokens": 70123, "eval/mean_tau_verify": 1.31, "heldout_top1_on_sharegpt": 0.301,
            "heldout_top1_on_regenerated": 0.452, "regeneration_minutes": 21.8, "minutes_to_last_step": 8.2}
    data = {"command": "python bench/regenerated_data.py --samples 300", "budget_min": 30.0,
            "regeneration": {"conversations": 300, "seconds": 1800.0}, "seconds_per_regenerated_conversation": 6.0,
            "training_seconds_per_sample": 2.25, "heads": {"regenerated_budget": head}}
    text = _rendered(tmp_path, "regen-data-x", "summary.json", data)
    assert "## `regen-data-x`" in text and "regenerated 300 conversations in 30.0 min (6.00 s each" in text
    assert "| regenerated_budget | 218 | 70123 | 1.310 | 0.301 | 0.452 | 21.8 | 8.200 |" in text


def test_the_gpu_check_has_its_table(tmp_path):
    data = {"device": "NVIDIA H200", "torch": "2.11.0", "date": "2026-12-04", "command": "python bench/gpu_check.py",
            "rows": [{"step": "kernels vs references (compiled)", "ok": True, "seconds": 43.2, "figure": "2 passed"},
                     {"step": "export", "ok": False, "seconds": 13.0, "figure": ""}]}
    text = _rendered(tmp_path, "gpu-x", "gpu_check.json", data)
    assert "## `gpu-x`" in text and "NVIDIA H200, torch 2.11.0, 2026-12-04" in text
    assert "| kernels vs references (compiled) | ok | 43 | 2 passed |" in text and "| export | FAILED | 13 |  |" in text


def test_the_linear_forms_bench_has_its_table(tmp_path):
    data = {"command": "python bench/linear_forms.py --sizes 32,64 --dtype float32", "target": "smollm2",
            "dtype": "float32", "torch": "2.13.0", "threads": 2, "sizes": [32, 64],
            "ms": {"linear": {"32": 104.8, "64": 142.7}, "onednn_packed": {"32": 42.6, "64": 68.4}}}
    text = _rendered(tmp_path, "forms-x", "linear_forms.json", data)
    assert "## `forms-x`" in text and "(smollm2, float32)" in text
    assert "| form | 32 tokens | 64 tokens |" in text and "| onednn_packed | 42.6 | 68.4 |" in text
