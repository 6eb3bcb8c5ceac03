"""Evaluation: a draft head's acceptance and teacher-forced agreement with the target, and decoding
methods measured side by side (prompts, Spec-Bench files, transformers baselines)."""
