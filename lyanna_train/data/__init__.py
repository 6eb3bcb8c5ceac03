"""Corpora in, documents out: file formats, conversations and chat templates."""
