"""The batch command's tests run the tiny fixture models, one torch thread each (as the engine's tests do)."""

from tests.unit.engine.conftest import _one_torch_thread  # noqa: F401 (an autouse fixture)
