"""The target model side: loading tokenizers/models (GGUF included) and fingerprints."""
