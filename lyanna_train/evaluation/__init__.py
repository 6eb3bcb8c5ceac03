"""Evaluation: a draft head's acceptance, and decoding methods measured side by side (Spec-Bench files, transformers baselines)."""
