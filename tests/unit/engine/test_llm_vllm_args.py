"""``LLM(...)`` with keywords of vLLM's ``LLM`` that are not Loraplex engine options, or with a mistyped one: the
error names ``LLM`` and the argument (it named ``EngineConfig.__init__()``), vLLM arguments that change nothing here
are accepted (with a warning when their value would matter under vLLM), and those Loraplex cannot honour are
refused saying so."""

from __future__ import annotations

import logging

import pytest

from loraplex import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, needles", [
    ({"no_such_option": 1}, ["'no_such_option'"]),
    ({"max_lora": 2}, ["'max_lora'", "did you mean 'max_loras'?"]),
])
def test_an_unknown_keyword_is_a_type_error_naming_llm_and_the_argument(kwargs, needles, tmp_path):
    # refused before anything loads: the model directory does not even exist
    with pytest.raises(TypeError) as info:
        LLM(str(tmp_path / "no-model"), **kwargs)
    message = str(info.value)
    assert message.startswith("LLM() got an unexpected keyword argument"), message
    assert "EngineConfig" not in message and all(n in message for n in needles), message


@pytest.mark.parametrize("kwargs, needles", [
    ({"revision": "main"}, ["revision='main'", "downloads nothing"]),
    ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2", "tensor_parallel_size"]),
    ({"cpu_offload_gb": 4}, ["cpu_offload_gb=4"]),
    ({"task": "embed"}, ["task='embed'", "only generates"]),
])
def test_a_vllm_argument_loraplex_cannot_honour_is_refused_saying_so(kwargs, needles, tmp_path):
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path / "no-model"), **kwargs)
    message = str(info.value)
    assert message.startswith("LLM(): vLLM's ") and "not supported" in message, message
    assert all(n in message for n in needles), message


def test_vllm_arguments_that_change_nothing_are_accepted_with_a_warning_only_where_vllm_would_differ(
        tiny_model, caplog):
    prompt = {"prompt_token_ids": [1, 40, 41, 42]}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = LLM(tiny_model["model_dir"], dtype="float32").generate(prompt, params)[0].outputs[0].token_ids
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.vllm_args"):
        # vLLM's defaults (also of the unsupported ones): silent
        quiet = LLM(tiny_model["model_dir"], dtype="float32", trust_remote_code=False, swap_space=4.0, revision=None,
                    pipeline_parallel_size=1, task="generate", disable_log_stats=True)
        assert caplog.records == []
        llm = LLM(tiny_model["model_dir"], dtype="float32", trust_remote_code=True, swap_space=16)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "trust_remote_code=True" in warnings[0] and "never code from a checkpoint" in warnings[0]
    assert "swap_space=16" in warnings[1]
    assert quiet.generate(prompt, params)[0].outputs[0].token_ids == want
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want


def test_vllms_none_for_enable_prefix_caching_means_its_default_on(tiny_model):
    """vLLM's ``enable_prefix_caching`` defaults to None (on for generation); None ran with the cache off."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_prefix_caching=None)
    assert llm.engine.block_manager.enable_prefix_caching is True
    assert not LLM(tiny_model["model_dir"], dtype="float32", enable_prefix_caching=False).engine.config.enable_prefix_caching
