"""LLMEngine: add requests, then ``step()`` = schedule -> execute -> update, returning token deltas."""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import os
import time
from pathlib import Path

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.lora_functions import LoRAFunctions
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.protocol import EngineStats, TokenDelta, TopLogprob
from loraplex.engine.request import Request, RequestStatus, TokenLogprobs
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.scheduler_output import PLACEHOLDER_TOKEN, SchedulerOutput
from loraplex.engine.step_sampler import PendingSample

log = logging.getLogger(__name__)

WAITING_ADAPTERS_SCAN = 256  # waiting requests looked at for EngineStats.waiting_adapters


def _adapter_names(requests) -> list[str]:
    """Distinct adapter names of these requests, sorted (vLLM's running/waiting_lora_adapters)."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def check_type(name: str, value, types, expected: str, where: str = "") -> None:
    """TypeError naming the argument unless ``value`` is one of ``types``; never a bool (not taken for a number)."""
    if not isinstance(value, types) or isinstance(value, bool):
        raise TypeError(f"{name}: must be {expected}, got {type(value).__name__} {value!r}{where}")


def _check_argument_types(request_id, prompt_token_ids, sampling_params, lora_request, cache_salt, priority,
                          arrival_time, prompt) -> None:
    """``add_request``'s arguments, checked before anything changes: a wrong type found later (e.g. a path
    string as lora_request, read by the adapter manager) left the request half added."""
    check_type("request_id", request_id, str, "a string")
    if isinstance(prompt_token_ids, (str, bytes, dict)) or not hasattr(prompt_token_ids, "__len__"):
        raise TypeError(f"prompt_token_ids: must be a list of token ids, got {type(prompt_token_ids).__name__} "
                        f"{prompt_token_ids!r:.100}")
    check_type("sampling_params", sampling_params, SamplingParams, "SamplingParams")
    check_type("lora_request", lora_request, (LoRARequest, type(None)), "a LoRARequest or None")
    check_type("cache_salt", cache_salt, (str, type(None)), "a string or None")
    check_type("priority", priority, numbers.Integral, "an integer")
    check_type("arrival_time", arrival_time, (numbers.Real, type(None)), "a number (time.monotonic()) or None")
    check_type("prompt", prompt, (str, type(None)), "a string or None")


# what a Hugging Face directory holds when it carries its own tokenizer (fast, sentencepiece or tiktoken files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        # transformers' own error here talks of missing sentencepiece/tiktoken packages
        raise ValueError(f"tokenizer: {path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy "
                         "the model's tokenizer there, or pass the directory that has it as the tokenizer")
    return AutoTokenizer.from_pretrained(path)


def check_local_dirs(config: EngineConfig) -> None:
    """The model and tokenizer directories exist (before anything loads): ValueError naming the argument."""
    model = Path(config.model)
    if not (model / "config.json").is_file():
        what = "is not a directory" if not model.is_dir() else "has no config.json"
        raise ValueError(f"model: {config.model} {what} (a Hugging Face model directory; Loraplex downloads nothing)")
    if config.tokenizer is not None and not Path(config.tokenizer).is_dir():
        raise ValueError(f"tokenizer: {config.tokenizer} is not a directory (one with the tokenizer's files; Loraplex "
                         "downloads nothing)")


def eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (what HF generate stops on)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _no_text(token_id: int) -> None:
    """A token's text for a request with detokenize=False: none."""
    return None


class LLMEngine(LoRAFunctions):  # add_lora, remove_lora, list_loras, pin_lora: vLLM's, in lora_functions.py
    def __init__(self, config: EngineConfig):
        from loraplex.engine.model_runner import ModelRunner

        check_local_dirs(config)
        self.config = config
        self.tp_driver = None  # tensor parallelism: the worker ranks (engine/parallel.py)
        if config.tensor_parallel_size > 1:
            from loraplex.engine import parallel

            parallel.check_shardable(json.loads((Path(config.model) / "config.json").read_text()),
                                     config.tensor_parallel_size)
            self.tp_driver = parallel.Driver(config)
        try:
            self.runner = ModelRunner(config)
            limit = self.runner.max_len_limit()
            if config.max_model_len is not None and config.max_model_len > limit:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
            config.resolve(limit)
            num_blocks = self.runner.start_up()
        except BaseException:
            if self.tp_driver is not None:
                self.tp_driver.abort()
            raise
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, adapters=self.runner.lora_manager)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob entries), at most the vocab
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self._pending: list[TokenDelta] = []  # deltas produced outside a step (errors, aborts)
        self._pinned_loras: set[int] = set()  # adapters of running requests, pinned in the LoRA manager
        self._num_samples: dict[str, int] = {}  # request_id -> n, while unfinished
        self._finished_indices: dict[str, set[int]] = {}
        self.num_generated_tokens = 0
        self._kv_waste_sum = 0.0
        self._tokens_per_second = 0.0
        self._token_wait_seconds = 0.0  # host time spent waiting for steps' sampled tokens (the device's work)
        self.num_step_seqs = 0  # sequences scheduled, summed over steps (÷ steps = the mean batch)
        self.num_prompt_steps = 0  # steps with more tokens than sequences: prompt chunks (no decode CUDA graph)
        # overlapped steps pay off where the device runs asynchronously to the host
        # (LORAPLEX_ASYNC_SCHEDULING=0/1 decides when the config leaves it open: A/B runs and CPU tests)
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            env = os.environ.get("LORAPLEX_ASYNC_SCHEDULING")
            # (speculative decoding needs each step's tokens on the host before it drafts the next: off with it)
            self.async_scheduling = env != "0" if env is not None else (
                self.runner.device.type == "cuda" and not config.num_speculative_tokens)
        self._inflight: tuple[SchedulerOutput, PendingSample] | None = None  # a step left running
        if self.tp_driver is not None:
            self.tp_driver.start(self.async_scheduling)
        self.num_overlapped_steps = 0
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens (%s, %.2f GB), max_model_len %d",
                 config.model, config.device, self.runner.dtype, num_blocks, config.block_size, self.runner.kv_dtype,
                 num_blocks * self.runner.bytes_per_block() / 1e9, config.max_model_len)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, prompt: str | None = None) -> None:
        """Queue a request. Bad input raises ValueError (TypeError for an argument of the wrong type), and so does
        a lora_request to an engine without enable_lora; an adapter that fails to load fails only this request
        (its deltas say finish_reason "error"). Returns at once: the adapter is read in the background and the
        scheduler admits the request once it is in host memory."""
        _check_argument_types(request_id, prompt_token_ids, sampling_params, lora_request, cache_salt, priority,
                              arrival_time, prompt)
        # the params as they are now (the caller may change and reuse its object): validated, and what the
        # engine caches on a params object (sampler flags, bias arrays) never goes stale
        sampling_params = sampling_params.snapshot()
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, sampling_params)
        if lora_request is not None and not self.config.enable_lora:  # vLLM refuses it too: nothing could run
            raise ValueError("lora_request: this engine was started without enable_lora; start it with "
                             "enable_lora=True to use adapters")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.model_config.vocab_size
        # plain ints: a float or string id would pass the range check and fail later inside a shared step
        bad = [t for t in prompt_token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        bad_words = []
        if sampling_params.bad_words:
            bad_words = sampling_params.bad_words_token_ids(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        sampling_params.check_token_ids(vocab, bad_words)
        req = Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                      sampling_params=sampling_params, eos_token_ids=self.eos_token_ids,
                      lora_request=lora_request, cache_salt=cache_salt, priority=priority, prompt=prompt,
                      bad_words_token_ids=bad_words,
                      **({"arrival_time": arrival_time} if arrival_time is not None else {}))
        self.scheduler.add_request(req)  # validates lengths and the id before anything else happens
        self._num_samples[request_id] = sampling_params.n
        self._finished_indices[request_id] = set()
        if lora_request is not None:
            try:
                manager = self.runner.get_lora_manager()
                if self.scheduler.adapters is None:
                    self.scheduler.adapters = manager
                manager.submit(lora_request)  # raises only for an id clash; a bad file fails it later
            except Exception as exc:  # noqa: BLE001 (any adapter failure fails this request only)
                log.warning("request %s: adapter %s failed: %s", request_id, lora_request.lora_name, exc)
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR, error=str(exc))
                self._pending.extend(self._final_deltas(request_id, [req]))
                return
        params = sampling_params
        if params.detokenize:  # without it the request has no text (and no stop strings: SamplingParams refuses them)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                                     params.stop, params.include_stop_str_in_output)

    def truncate_prompt(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt tokens that run: the last ``truncate_prompt_tokens`` of them (-1: ``max_model_len``), else
        all. SamplingParamsError for a truncation over ``max_model_len``."""
        keep = sampling_params.prompt_tokens_kept(self.config.max_model_len)
        if keep is None or len(prompt_token_ids) <= keep:
            return prompt_token_ids
        return list(prompt_token_ids)[-keep:]

    def abort_request(self, request_id: str) -> None:
        aborted = self.scheduler.abort_request(request_id)
        if aborted or request_id in self._num_samples:
            self._pending.extend(self._final_deltas(request_id, aborted))

    def take_back(self, request_id: str) -> None:
        """Remove a request added since the last step as if it had never been added: no step has run it, and
        no delta of it is reported (its id is free at once)."""
        self.scheduler.abort_request(request_id)
        self._pending = [d for d in self._pending if d.request_id != request_id]
        self._num_samples.pop(request_id, None)
        self._finished_indices.pop(request_id, None)

    def remove_adapter(self, adapter_id: int) -> None:
        """Forget an adapter (host copy, slot, prefix-cache blocks computed with it) once no running request
        uses it; a later request may register other weights under the same id."""
        manager = self.runner.lora_manager
        if manager is None:
            return
        self._sync_adapter_pins()  # requests that finished since the last step no longer hold the adapter
        manager.remove_adapter(adapter_id)
        if self.tp_driver is not None:
            self.tp_driver.remove_adapter(adapter_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one process); the engine takes no steps after."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or self._inflight is not None

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Schedule and run one step; returns the token deltas that became known.

        Overlapped steps (``async_scheduling``): a step whose sampling needs nothing from the host is
        left running on the device while the call returns; the next call schedules and queues the
        following step first (its sequences' newest token is a placeholder that the device fills in from
        the running step's samples), and only then waits for the running step's tokens and applies them,
        so the host's scheduling, detokenization and bookkeeping overlap the device's work. Deltas of a
        step therefore arrive one call later; a sequence that stops at step n on a token nobody could
        predict (EOS, stop token or string) has also been run in step n + 1, whose token for it is dropped
        (one that reaches max_tokens is not scheduled again). Steps with prompt logprobs or forks run
        synchronously."""
        deltas, self._pending = self._pending, []
        started = time.monotonic()
        prev, self._inflight = self._inflight, None
        out = self.scheduler.schedule()
        self._kv_waste_sum += self.scheduler.last_kv_waste
        if out.scheduled:
            self.num_step_seqs += len(out.scheduled)
            self.num_prompt_steps += out.has_prompt_chunks
        if self.runner.lora_manager is not None:
            self._pin_running_adapters()
        if self.tp_driver is not None:
            self.tp_driver.step(out, prev is not None)  # the workers launch the same step on their shards
        pending = self.runner.launch(out, prev[1] if prev is not None else None)
        num_new = 0
        if prev is not None:
            num_new += self._complete(prev[0], prev[1], deltas, provisional=True)
        if self.async_scheduling and pending.is_async:
            self._apply_provisional(out)
            self._inflight = (out, pending)
            self.num_overlapped_steps += 1
        else:
            num_new += self._complete(out, pending, deltas, provisional=False)
        if num_new:
            self.num_generated_tokens += num_new
            rate = num_new / max(time.monotonic() - started, 1e-9)
            self._tokens_per_second = 0.9 * self._tokens_per_second + 0.1 * rate
        for d in deltas:
            if d.finished:
                self._mark_finished(d.request_id, d.index)
        return deltas

    @property
    def device_wait_seconds(self) -> float:
        """Host time the steps spent blocked on the device: waiting for sampled tokens, and in the input builder
        for the previous step's input copies (which queue behind the step before them)."""
        inputs = getattr(self.runner, "inputs", None)
        return self._token_wait_seconds + (getattr(inputs, "copy_wait_seconds", 0.0) if inputs is not None else 0.0)

    def _complete(self, out: SchedulerOutput, pending: PendingSample, deltas: list[TokenDelta],
                  provisional: bool) -> int:
        """Wait for a step's tokens, apply them, and append the deltas; returns how many samples got one."""
        waited = time.perf_counter()
        result = pending.result()
        self._token_wait_seconds += time.perf_counter() - waited
        extra = self._undo_provisional(out, result) if provisional else []
        before = self.scheduler.num_extra_tokens
        touched = self.scheduler.update_from_output(out, result)
        for req in extra + touched:
            deltas.append(self._delta(req))
        # a speculating sequence may get several tokens in one step
        return len(extra) + len(touched) + self.scheduler.num_extra_tokens - before

    def _apply_provisional(self, out: SchedulerOutput) -> None:
        """What ``update_from_output`` will do for a step still running, as far as the host knows it now:
        its tokens count as computed and each sampling sequence has a placeholder for its new token, so
        the next step can be scheduled at once."""
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        for s in out.scheduled:
            req = s.request
            if req.status is running:  # not finished by the step completed meanwhile
                req.num_computed_tokens += s.num_new_tokens
                if s.num_samples:
                    req.token_ids.append(PLACEHOLDER_TOKEN)
                    max_tokens = req.sampling_params.max_tokens
                    req.finishing = (len(req.token_ids) >= max_model_len or
                                     (max_tokens is not None and req.num_output_tokens >= max_tokens))

    def _undo_provisional(self, out: SchedulerOutput, result) -> list:
        """Take a completed step's provisional state back before ``update_from_output`` applies the real
        one. A sequence preempted meanwhile (it waits with num_computed_tokens 0) gets its real token in
        place of the placeholder here, since the update skips sequences that are not running; returns
        those, which have a new token to report."""
        running = RequestStatus.RUNNING
        reported = []
        for s in out.scheduled:
            req = s.request
            req.finishing = False
            has_placeholder = bool(s.num_samples) and req.token_ids[-1] == PLACEHOLDER_TOKEN
            if req.status is running:
                req.num_computed_tokens -= s.num_new_tokens
                if s.num_samples:
                    assert has_placeholder, "a running sequence lost its placeholder"
                    req.token_ids.pop()
            elif has_placeholder and req.status.finished:
                req.token_ids.pop()  # aborted or failed while the step ran: its token is dropped
            elif has_placeholder:  # preempted by the scheduling of the step after this one
                req.token_ids.pop()
                lps = result.sampled_logprobs.get(req.seq_id)
                entries = result.logprobs.get(req.seq_id)
                self.scheduler.apply_token(req, result.sampled_token_ids[req.seq_id][0], lps[0] if lps else None,
                                           entries[0] if entries else None, time.monotonic())
                reported.append(req)
        return reported

    def _pin_running_adapters(self) -> None:
        """LoRA work of a step, after scheduling: requests whose adapter read failed get their final
        deltas (sent with the next step's); running requests' adapters keep their GPU slots (only adapters
        of waiting or finished requests are evicted; the scheduler keeps the running adapters within
        max_loras); then the adapters of the next waiting requests are copied into free or evictable slots
        while this step runs."""
        for request_id, samples in self.scheduler.take_failed():
            log.warning("request %s: adapter failed: %s", request_id, samples[0].error if samples else "")
            self._pending.extend(self._final_deltas(request_id, samples))
        self._sync_adapter_pins()
        self.runner.lora_manager.prefetch_slots()

    def _sync_adapter_pins(self) -> None:
        """Pin the adapters of running requests in the LoRA manager, and only those."""
        manager = self.runner.lora_manager
        running = {r.lora_id for r in self.scheduler.running if r.lora_id}
        for lora_id in running - self._pinned_loras:
            manager.acquire(lora_id)
        for lora_id in self._pinned_loras - running:
            manager.release(lora_id)
        self._pinned_loras = running

    def _mark_finished(self, request_id: str, index: int) -> None:
        done = self._finished_indices.get(request_id)
        if done is None:
            return
        done.add(index)
        if len(done) >= self._num_samples[request_id]:
            del self._finished_indices[request_id], self._num_samples[request_id]

    def _final_deltas(self, request_id: str, samples: list[Request]) -> list[TokenDelta]:
        """Final deltas for finished samples, plus samples that were never forked (abort/error early)."""
        deltas = [self._delta(r) for r in samples]
        have = {r.index for r in samples} | self._finished_indices.get(request_id, set())
        if samples:
            template = samples[0]
            for index in range(self._num_samples.get(request_id, 1)):
                if index not in have:
                    deltas.append(TokenDelta(
                        request_id=request_id, index=index, token_ids=[], text="", finished=True,
                        finish_reason=template.status.finish_reason, error=template.error,
                        num_prompt_tokens=template.num_prompt_tokens,
                        num_computed_prompt_tokens=template.num_computed_prompt_tokens, finished_time=time.monotonic()))
        return deltas

    def _delta(self, req: Request) -> TokenDelta:
        finished = req.is_finished
        sent = req.num_sent_tokens
        new_ids = req.token_ids[req.num_prompt_tokens + sent:]  # not output_token_ids[sent:]: no full copy
        num_generated = req.num_output_tokens
        if new_ids and new_ids[-1] == PLACEHOLDER_TOKEN:  # aborted with a step in flight: not a token
            new_ids.pop()
            num_generated -= 1
        text = ""
        if req.detokenizer is not None:
            upto = max(req.num_sent_chars, req.detokenizer.streamable_text_len(finished))
            text = req.detokenizer.output_text[req.num_sent_chars:upto]
            req.num_sent_chars = upto
        first = req.num_deltas == 0
        req.num_deltas += 1
        req.num_sent_tokens = num_generated
        params = req.sampling_params
        logprobs = None
        decode = params.detokenize
        if params.logprobs is not None:
            logprobs = [self._logprob_entry(lp, decode) for lp in req.logprobs[sent:]]
        prompt_logprobs = None
        # a one-token prompt has no position to score: its list is position 0's None alone, as for every prompt
        if first and params.prompt_logprobs is not None and (req.prompt_logprobs or req.num_prompt_tokens == 1):
            prompt_logprobs = [None if lp is None else self._logprob_entry(lp, decode)
                               for lp in req.prompt_logprobs or [None]]
        return TokenDelta(
            request_id=req.request_id, index=req.index, token_ids=new_ids, text=text, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, finished=finished, finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, num_computed_prompt_tokens=req.num_computed_prompt_tokens,
            num_generated_tokens=num_generated,
            # as vLLM: None unless the request asked for logprobs
            cumulative_logprob=req.cumulative_logprob if params.logprobs is not None else None,
            error=req.error, first_scheduled_time=req.first_scheduled_time if first else None,
            first_token_time=req.first_token_time if first else None,
            finished_time=req.finished_time if finished else None,
        )

    def _logprob_entry(self, lp: TokenLogprobs, decode: bool = True) -> tuple[float, list[TopLogprob]]:
        text = self._token_text if decode else _no_text
        tops = [TopLogprob(t, v, text(t), rank=i + 1) for i, (t, v) in enumerate(zip(lp.top_token_ids,
                                                                                      lp.top_logprobs))]
        if lp.token_id not in lp.top_token_ids:
            tops.append(TopLogprob(lp.token_id, lp.logprob, text(lp.token_id), rank=lp.rank))
        return lp.logprob, tops

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone (a pure function of the id: cached, one tokenizer call per id ever)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- observability -------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        manager = self.runner.lora_manager
        active = []
        if manager is not None and hasattr(manager, "active_adapter_names"):
            active = list(manager.active_adapter_names())
        merged = getattr(manager, "merged", None)
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage, prefix_cache_hit_rate=self.block_manager.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions, active_adapters=active,
            running_adapters=_adapter_names(self.scheduler.running),
            # the head of the queue only: a long backlog must not cost every step a full scan
            waiting_adapters=_adapter_names(itertools.islice(self.scheduler.waiting, WAITING_ADAPTERS_SCAN)),
            tokens_per_second=self._tokens_per_second,
            num_lora_loads=getattr(manager, "num_loads", 0), num_lora_evictions=getattr(manager, "num_evictions", 0),
            lora_load_queue_depth=getattr(manager, "num_pending_loads", 0),
            lora_host_load_seconds=getattr(manager, "host_load_seconds", 0.0),
            num_lora_load_failures=getattr(manager, "num_load_failures", 0),
            num_lora_host_loads=getattr(manager, "num_host_loads", 0),
            num_lora_merges=merged.num_merges if merged is not None else 0,
            num_lora_merged_steps=merged.num_merged_steps if merged is not None else 0,
            device_wait_seconds=self.device_wait_seconds,
            spec_draft_tokens=self.scheduler.num_draft_tokens, spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            step_seqs=self.num_step_seqs, prompt_steps=self.num_prompt_steps,
            piecewise_graph_steps=self.runner.piecewise.num_steps if self.runner.piecewise is not None else 0,
            num_kv_blocks=self.block_manager.num_blocks, block_size=self.config.block_size,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            enable_prefix_caching=self.block_manager.enable_prefix_caching,
        )

    @property
    def counters(self) -> dict[str, float]:
        bm, sched, manager = self.block_manager, self.scheduler, self.runner.lora_manager
        counters = {
            "num_kv_blocks": bm.num_blocks, "num_used_blocks": bm.num_used_blocks, "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_hit_rate, "prefix_cache_query_tokens": bm.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens, "prefix_cache_evictions": bm.num_evictions,
            "cow_block_copies": bm.num_cow_copies, "num_preemptions": sched.num_preemptions,
            "num_computed_prompt_tokens": sched.num_computed_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens, "num_steps": sched.num_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            # steps that replayed a decode graph, and steps that replayed piecewise graphs (prefill / mixed)
            "num_decode_graph_steps": self.runner.graphs.num_replays if self.runner.graphs is not None else 0,
            "num_piecewise_graph_steps": self.runner.piecewise.num_steps if self.runner.piecewise is not None else 0,
            "num_adapter_wait_steps": sched.num_adapter_wait_steps, "adapter_wait_seconds": sched.adapter_wait_seconds,
            "kv_waste_last": sched.last_kv_waste,
            "spec_draft_tokens": sched.num_draft_tokens, "spec_accepted_tokens": sched.num_accepted_tokens,
            "kv_waste_mean": self._kv_waste_sum / sched.num_steps if sched.num_steps else 0.0,
        }
        if manager is not None:
            counters.update({
                "lora_slot_loads": manager.num_loads, "lora_prefetched_slot_loads": manager.num_prefetched_loads,
                "lora_prefetch_deferrals": manager.num_prefetch_deferrals,
                "lora_slot_evictions": manager.num_evictions, "lora_host_loads": manager.num_host_loads,
                "lora_slot_moves": manager.num_slot_moves, "lora_gemm_shrink_steps": manager.num_gemm_shrink_steps,
                "lora_host_reuses": manager.num_host_reuses, "lora_load_failures": manager.num_load_failures,
                "lora_host_load_seconds": manager.host_load_seconds,
                "lora_load_queue_depth": manager.num_pending_loads,
                "lora_loading_adapters": manager.num_loading_adapters,
            })
            merged = manager.merged  # merge_single_lora: one adapter folded into the weights
            counters.update({"lora_merges": merged.num_merges if merged else 0,
                             "lora_merged_steps": merged.num_merged_steps if merged else 0})
        return counters
