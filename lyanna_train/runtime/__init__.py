"""Serving: speculative decoding from an exported draft head (torch + transformers only)."""
