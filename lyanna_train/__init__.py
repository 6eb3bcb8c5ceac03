"""Lyanna Train: hot-vocabulary draft heads for LLM speculative decoding.

Importing the package is cheap and needs neither CUDA, Triton nor DeepSpeed;
each stage lives in its own subpackage (``hotvocab``, ``data``, ``target``, ``cli``).
"""

__version__ = "0.1.0"
