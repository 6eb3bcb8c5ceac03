"""Distillation losses: KL to the target over the hot vocabulary, hidden-state regression."""
