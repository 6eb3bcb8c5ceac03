"""Serving: greedy chain speculative decoding with a draft head (torch + transformers only)."""
