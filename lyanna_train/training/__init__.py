"""Distillation on DeepSpeed: config schema, batches, the loss step, checkpoints, tracking, loop."""
