"""The offline API (vLLM-compatible): ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Sequence

from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine, check_type
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import CompletionOutput, RequestOutput, apply_delta
from loraplex.engine.sampling_params import SamplingParams, snapshots
from loraplex.engine.vllm_args import engine_options

Prompt = str | dict
log = logging.getLogger(__name__)

# keys of vLLM's prompt dicts (TextPrompt, TokensPrompt, EmbedsPrompt) that ask for inputs a text-only engine lacks:
# refused unless empty, since dropping them would answer another question than the one asked
_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                            "token_type_ids")
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


_SPEC_KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
              "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"}


def _speculative_options(spec: dict) -> dict:
    """vLLM's ``speculative_config`` ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ...,
    "prompt_lookup_min": ...}) as EngineConfig fields."""
    if not isinstance(spec, dict):
        raise TypeError(f"speculative_config: must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(_SPEC_KEYS)}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    return {_SPEC_KEYS[k]: v for k, v in spec.items()}


class LLM:
    def __init__(self, model: str, *, enable_lora: bool = False, max_loras: int = 8, max_lora_rank: int = 64,
                 max_cpu_loras: int | None = None, device: str = "cpu", dtype: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool | None = True, seed: int | None = 0, tokenizer: str | None = None,
                 speculative_config: dict | None = None, **kwargs):
        kwargs = engine_options(kwargs)  # vLLM's other keywords: dropped, or refused naming them
        if enable_prefix_caching is None:  # vLLM's default value, which turns it on for generation
            enable_prefix_caching = True
        if speculative_config is not None:
            kwargs.update(_speculative_options(speculative_config))
        config = EngineConfig(
            model=str(model), tokenizer=tokenizer, device=device, dtype=dtype, seed=seed, block_size=block_size,
            num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        if config.freeze_gc:
            from loraplex.engine.gc_heap import freeze_heap

            freeze_heap()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine: ``llm.llm_engine.add_lora(...)``, ``remove_lora``, ``list_loras``, ``pin_lora``
        (loraplex/engine/lora_functions.py); the same object as ``llm.engine``."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op for a single-process engine."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: must be a prompt (a string or a dict) or a list of them, got "
                            f"{type(prompts).__name__} {prompts!r}")
        num = len(prompts)
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority: must be a list of integers, one per prompt, got {priority!r}")
        params = _per_prompt(sampling_params or SamplingParams(), num, "sampling_params")
        loras = _per_prompt(lora_request, num, "lora_request")
        priorities = _per_prompt(list(priority) if priority is not None else 0, num, "priority")
        # types before anything is queued: a wrong one found inside the engine may leave a request half added
        _check_types("sampling_params", params, SamplingParams, "SamplingParams")
        _check_types("lora_request", loras, (LoRARequest, type(None)), "LoRARequest or None")
        _check_types("priority", priorities, numbers.Integral, "an integer")
        # what runs is each params object as it is now (the caller may change and reuse it)
        params = snapshots(params)
        outputs: dict[str, RequestOutput] = {}  # in the order of prompts
        try:
            for prompt, p, lora, prio in zip(prompts, params, loras, priorities):
                request_id, out = self._add_request(prompt, p, lora, prio)
                outputs[request_id] = out
        except BaseException:
            self._abandon(outputs)  # all or nothing: a bad prompt leaves no work behind
            raise
        return self._run(outputs)

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None]
             | None = None, use_tqdm: bool = False, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them, each
        through the tokenizer's chat template (the server's path: ``chat_template_ids``), then ``generate``."""
        from loraplex.engine.chat import chat_messages, chat_template_ids, template_call_parameters

        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(f"messages: must be a conversation (a list of message dicts) or a list of them, got "
                            f"{messages!r:.80}")
        single = isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict):
                raise TypeError(f"chat_template_kwargs: must be a dict of template variables, got "
                                f"{chat_template_kwargs!r:.80}")
            clash = sorted(set(chat_template_kwargs) & template_call_parameters(tokenizer))
            if clash:
                raise ValueError(f"chat_template_kwargs.{clash[0]}: a parameter of the template call, not a template "
                                 "variable (add_generation_prompt and continue_final_message are chat()'s own)")
        prompts = []
        for c, conversation in enumerate(conversations):
            if not isinstance(conversation, (list, tuple)) or not conversation:
                raise TypeError(f"messages[{c}]: must be a non-empty list of message dicts, got {conversation!r:.80}")
            rendered = chat_messages(conversation, "messages" if single else f"messages[{c}]")
            ids = chat_template_ids(tokenizer, rendered, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs)
            prompts.append({"prompt_token_ids": ids, "prompt": tokenizer.decode(ids, skip_special_tokens=False)})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def _add_request(self, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None,
                     priority: int) -> tuple[str, RequestOutput]:
        """Queue one prompt (ValueError for a bad one, nothing queued); its output fills in as it runs. A prompt is a
        string, ``{"prompt_token_ids": [...]}`` (``"prompt"`` beside it is only echoed) or ``{"prompt": text}``; a
        dict may carry vLLM's ``"cache_salt"`` (a string: prompts with other salts never share its prefix cache)."""
        cache_salt = _cache_salt(prompt)
        text, token_ids = self._tokenize(prompt)
        # the output's prompt_token_ids are those that run (vLLM's truncate_prompt_tokens); its prompt stays as given
        token_ids = self.engine.truncate_prompt(token_ids, params)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, token_ids, params, lora_request=lora, cache_salt=cache_salt,
                                priority=priority, prompt=text)
        samples = [CompletionOutput(index=i) for i in range(params.n)]
        return request_id, RequestOutput(request_id, text, token_ids, samples)

    def _run(self, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        """Step until the engine is idle; an exception (a failed step, Ctrl-C) aborts these requests first, so
        the engine is left empty and usable."""
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    out = outputs.get(delta.request_id)
                    if out is not None:
                        apply_delta(out, delta)
        except BaseException:
            self._abandon(outputs)
            raise
        return list(outputs.values())

    def _abandon(self, request_ids) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        try:
            while self.engine.has_unfinished_requests():  # the abort deltas, and a step left in flight
                self.engine.step()
        except Exception:  # noqa: BLE001 (the caller re-raises the first error)
            log.exception("engine step failed while aborting the requests of a failed generate()")

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                                          for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise ValueError("each prompt must be a string, a dict with 'prompt_token_ids', or a dict with 'prompt' "
                         f"(a string), got {type(prompt).__name__} {prompt!r:.80}")


def _cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's ``cache_salt``, its keys checked: ValueError naming a key this engine cannot honour."""
    if not isinstance(prompt, dict):
        return None
    for key in prompt:
        if key in _UNSUPPORTED_PROMPT_KEYS:
            if prompt[key] is None or (hasattr(prompt[key], "__len__") and len(prompt[key]) == 0):
                continue
            raise ValueError(f"{key}: not supported (Loraplex serves text-only models); leave it out of the prompt")
        if key not in _PROMPT_KEYS:
            raise ValueError(f"{key}: not a prompt key; a prompt dict has 'prompt_token_ids' or 'prompt' (a string), "
                             "and may have 'cache_salt' (a string)")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt: must be a string, got {type(salt).__name__} {salt!r:.80}")
    return salt


def _check_types(name: str, values: list, types, expected: str) -> None:
    for i, value in enumerate(values):
        check_type(name, value, types, expected, f" (prompt {i})" if len(values) > 1 else "")


def _per_prompt(value, num: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num:
            raise ValueError(f"{name}: got {len(value)} values for {num} prompts")
        return list(value)
    return [value] * num
