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



def test_a_misspelt_variable_is_reported_with_the_setting_it_resembles(tmp_path, caplog, monkeypatch):
    from loraplex.cli import main
    from loraplex.settings import unknown_variables

    env = {"LORAPLEX_DATABASEURL": "postgresql+asyncpg://db/x", "LORAPLEX_URL": "http://x", "LORAPLEX_PORT": "1"}
    assert unknown_variables(env) == ["LORAPLEX_DATABASEURL (did you mean LORAPLEX_DATABASE_URL?)"]
    monkeypatch.setenv("LORAPLEX_MAX_LORA", "4")
    main(["admin", "tenant", "list", "--data-dir", str(tmp_path / "none")])
    assert "ignoring LORAPLEX_MAX_LORA (did you mean LORAPLEX_MAX_LORAS?)" in caplog.text


def test_merge_single_lora_reaches_the_engine_config_only_with_adapters_on(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    on = Settings.from_env({"LORAPLEX_MERGE_SINGLE_LORA": "true", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(on, Path(tmp_path), "m").merge_single_lora is True
    off = Settings.from_env({"LORAPLEX_MERGE_SINGLE_LORA": "true", "LORAPLEX_ENABLE_LORA": "false",
                             "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(off, Path(tmp_path), "m").merge_single_lora is False
    assert engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m").merge_single_lora is False


def test_loop_torch_threads_reaches_the_engine_config(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    assert engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m").loop_torch_threads is None
    four = Settings.from_env({"LORAPLEX_LOOP_TORCH_THREADS": "4", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(four, Path(tmp_path), "m").loop_torch_threads == 4


def test_prefill_batching_is_on_for_the_server_and_reaches_the_engine_config(tmp_path):
    from pathlib import Path

    from loraplex.engine.config import EngineConfig
    from loraplex.platform.engine_boot import engine_config

    default = engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m")
    assert (default.prefill_batch_min_tokens, default.prefill_batch_max_wait_steps) == (1024, 8)
    assert default.prefill_batch_min_running == 32
    assert EngineConfig().prefill_batch_min_tokens == 0  # the engine and the offline LLM keep it off
    custom = engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu", "LORAPLEX_PREFILL_BATCH_MIN_TOKENS": "0",
                                              "LORAPLEX_PREFILL_BATCH_MAX_WAIT_STEPS": "3"}), Path(tmp_path), "m")
    assert (custom.prefill_batch_min_tokens, custom.prefill_batch_max_wait_steps) == (0, 3)


def test_lora_expand_first_min_tokens_reaches_the_engine_config(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    default = engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m")
    assert default.lora_expand_first_min_tokens == 128
    off = Settings.from_env({"LORAPLEX_LORA_EXPAND_FIRST_MIN_TOKENS": "0", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(off, Path(tmp_path), "m").lora_expand_first_min_tokens == 0
    with pytest.raises(ValueError, match="lora_expand_first_min_tokens must be >= 0"):
        engine_config(Settings.from_env({"LORAPLEX_LORA_EXPAND_FIRST_MIN_TOKENS": "-1", "LORAPLEX_DEVICE": "cpu"}),
                      Path(tmp_path), "m")


def test_lora_gemm_shrink_reaches_the_engine_config(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    default = engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m")
    assert (default.lora_gemm_shrink, default.lora_gemm_shrink_max_tokens) == (False, 64)
    on = Settings.from_env({"LORAPLEX_LORA_GEMM_SHRINK": "1", "LORAPLEX_LORA_GEMM_SHRINK_MAX_TOKENS": "32",
                            "LORAPLEX_DEVICE": "cpu"})
    got = engine_config(on, Path(tmp_path), "m")
    assert (got.lora_gemm_shrink, got.lora_gemm_shrink_max_tokens) == (True, 32)
    with pytest.raises(ValueError, match="lora_gemm_shrink_max_tokens must be >= 1"):
        engine_config(Settings.from_env({"LORAPLEX_LORA_GEMM_SHRINK_MAX_TOKENS": "0", "LORAPLEX_DEVICE": "cpu"}),
                      Path(tmp_path), "m")


def test_lora_segment_tiles_reaches_the_engine_config(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    assert engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m").lora_segment_tiles is False
    on = Settings.from_env({"LORAPLEX_LORA_SEGMENT_TILES": "true", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(on, Path(tmp_path), "m").lora_segment_tiles is True


def test_kv_cache_dtype_reaches_the_engine_config_and_a_bad_one_is_named(tmp_path):
    from pathlib import Path

    from loraplex.platform.engine_boot import engine_config

    assert engine_config(Settings.from_env({"LORAPLEX_DEVICE": "cpu"}), Path(tmp_path), "m").kv_cache_dtype == "auto"
    fp8 = Settings.from_env({"LORAPLEX_KV_CACHE_DTYPE": "fp8", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(fp8, Path(tmp_path), "m").kv_cache_dtype == "fp8"
    int8 = Settings.from_env({"LORAPLEX_KV_CACHE_DTYPE": "int8", "LORAPLEX_DEVICE": "cpu"})
    assert engine_config(int8, Path(tmp_path), "m").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, int8, got 'int4'"):
        engine_config(Settings.from_env({"LORAPLEX_KV_CACHE_DTYPE": "int4", "LORAPLEX_DEVICE": "cpu"}),
                      Path(tmp_path), "m")
