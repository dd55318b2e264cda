import pytest

from loraplex.settings import Settings


def test_env_prefix_and_types():
    s = Settings.from_env({"LORAPLEX_PORT": "9001", "LORAPLEX_ENABLE_LORA": "false", "LORAPLEX_DATA_DIR": "/x",
                           "LORAPLEX_GPU_MEMORY_UTILIZATION": "0.5"})
    assert (s.port, s.enable_lora, s.data_dir, s.gpu_memory_utilization) == (9001, False, "/x", 0.5)
    assert s.embedded and s.effective_database_url == "sqlite+aiosqlite:////x/loraplex.db"


def test_overrides_win_and_bad_values_name_the_variable():
    s = Settings.from_env({"LORAPLEX_PORT": "9001"}, port=9002)
    assert s.port == 9002
    with pytest.raises(ValueError, match="LORAPLEX_PORT"):
        Settings.from_env({"LORAPLEX_PORT": "many"})
