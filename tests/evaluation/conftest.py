"""The runtime tests' tiny target and helpers serve evaluation too (it drives the runtime)."""

from ..runtime.conftest import _tiny_models_on_one_thread, tiny_target  # noqa: F401 - fixtures, by name
