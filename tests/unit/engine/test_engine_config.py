"""EngineConfig refuses what no engine can run, with the field named: a device this process cannot use (it was a
bare AssertionError from inside torch when the engine built its model) and a max_model_len that leaves no room
for a prompt token and a generated one (it started, then refused every request)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.llm import LLM


@pytest.mark.parametrize("device", ["tpu", "bogus", "cuda:x"])
def test_an_unknown_device_is_refused(device):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N'"):
        EngineConfig(model="m", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match=r"device 'cuda': CUDA is not available .*use device='cpu'"):
        LLM(tiny_model["model_dir"], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_index_past_the_visible_ones_is_refused():
    with pytest.raises(ValueError, match="GPU"):
        EngineConfig(model="m", device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("value", [0, 1, -5])
def test_max_model_len_below_two_is_refused(value):
    with pytest.raises(ValueError, match=f"max_model_len must be >= 2 .*got {value}"):
        EngineConfig(model="m", max_model_len=value)


def test_cpu_and_a_small_max_model_len_are_accepted():
    assert EngineConfig(model="m", device="cpu", max_model_len=2).max_model_len == 2


@pytest.mark.parametrize("given, dtype", [("half", "float16"), ("float", "float32"), (torch.float16, "float16"),
                                          (torch.bfloat16, "bfloat16"), ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_vllms_dtype_spellings_name_the_same_dtype(given, dtype):
    """vLLM's ``dtype`` takes "half" and "float" (float32) and torch dtypes beside the names; code written for it runs
    the same precision here."""
    assert EngineConfig(model="m", dtype=given).dtype == dtype


@pytest.mark.parametrize("given", ["float8", "fp16", torch.int8, 16])
def test_an_unknown_dtype_is_refused_naming_the_field_and_the_choices(given):
    with pytest.raises(ValueError, match=r"^dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(model="m", dtype=given)


def test_seed_none_is_vllms_unseeded_engine_a_random_seed_fixed_once():
    """vLLM's ``LLM(seed=None)`` was a RuntimeError from inside torch ("manual_seed expected a long"); it is a seed
    drawn once, so every part of the engine (and tensor-parallel ranks, which get the config) uses the same one."""
    seeds = {EngineConfig(model="m", seed=None).seed for _ in range(4)}
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and len(seeds) > 1
    assert EngineConfig(model="m", seed=7).seed == 7


@pytest.mark.parametrize("seed", [1.5, "1", True, 2**64, -(2**63) - 1])
def test_a_seed_that_is_no_64_bit_integer_is_refused_naming_the_field(seed):
    with pytest.raises(ValueError, match=r"^seed must be an integer"):
        EngineConfig(model="m", seed=seed)


@pytest.mark.parametrize("field, value, expected", [
    ("block_size", 1.5, "an integer"), ("max_model_len", "64", "an integer or None"), ("max_loras", None, "an integer"),
    ("max_lora_rank", None, "an integer"), ("num_speculative_tokens", 2.5, "an integer"),
    ("enable_lora", "yes", "true or false"), ("kv_cache_memory_gb", "1", "a number"), ("model", 5, "a string"),
    ("max_num_seqs", True, "an integer"),
])
def test_an_option_of_the_wrong_type_is_refused_naming_it(field, value, expected):
    """Each was a TypeError from deep inside the engine's start-up ("empty(): argument 'size' must be tuple of ints",
    "'<' not supported between instances of 'NoneType' and 'int'") or, for num_speculative_tokens=2.5, accepted."""
    with pytest.raises(ValueError, match=f"^{field} must be {expected}, got "):
        EngineConfig(**{"model": "m", field: value})


def test_paths_and_numpy_integers_are_options_of_their_kind(tmp_path):
    np = pytest.importorskip("numpy")
    config = EngineConfig(model=tmp_path, tokenizer=tmp_path, max_num_seqs=np.int64(4), kv_cache_memory_gb=1)
    assert config.model == config.tokenizer == str(tmp_path)
    assert config.max_num_seqs == 4 and type(config.max_num_seqs) is int


def test_a_model_or_tokenizer_directory_that_is_not_there_is_refused_naming_the_argument(tiny_model, tmp_path):
    """A missing model was a FileNotFoundError about config.json from inside the runner; a missing tokenizer
    directory, after the whole model had loaded, Hugging Face Hub's "Repo id must use alphanumeric chars"."""
    with pytest.raises(ValueError, match=r"^model: .*no-model is not a directory"):
        LLM(str(tmp_path / "no-model"))
    with pytest.raises(ValueError, match=r"^model: .* has no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match=r"^tokenizer: .*no-tokenizer is not a directory"):
        LLM(tiny_model["model_dir"], tokenizer=str(tmp_path / "no-tokenizer"))


@pytest.mark.parametrize("field, value", [("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
                                          ("gpu_memory_utilization", float("nan")), ("kv_cache_memory_gb", 0),
                                          ("kv_cache_memory_gb", -1.0)])
def test_memory_fractions_and_sizes_out_of_range_are_refused_naming_the_field(field, value):
    """gpu_memory_utilization=1.5 sized the KV cache past the GPU's memory (vLLM takes (0, 1]); kv_cache_memory_gb=-1
    said "KV cache of -131072 blocks" without naming the option."""
    with pytest.raises(ValueError, match=f"^{field} must be "):
        EngineConfig(**{"model": "m", field: value})
