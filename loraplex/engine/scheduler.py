"""Iteration-level scheduler (pure Python, no torch).

Every step: running sequences first (in priority order), each gets its remaining tokens up to the step's
token budget (one for a decode, a chunk for a prefill); when KV blocks run out the lowest-priority running
sequence is preempted (its blocks freed, recomputed later). Then waiting requests are admitted in order
(lower ``priority`` value first, FCFS within one) while the budget, ``max_num_seqs``, free blocks and the
``max_loras`` distinct-adapter limit allow; a waiting request of higher priority may preempt lower-priority
running work. ``update_from_output`` applies the sampled tokens, forks ``n > 1`` samples once the prompt
is computed, checks stop conditions and frees finished sequences' blocks.

Adapters (when the engine sets ``adapters``, its LoRA manager): each step starts with ``adapters.poll``,
which takes finished background reads and reads ahead for the first waiting requests; a request whose
adapter read failed fails (``take_failed``). A waiting request whose adapter is not yet in host memory is
skipped: it keeps its place and blocks nobody behind it. Within one priority, requests that need no new
adapter slot (base model, or an adapter already running or resident) are admitted before those that do;
a request passed over that way ages like one kept out by ``max_loras`` (``wait_steps``), and once aged
(``lora_max_wait_steps``) takes its FCFS place again, so nothing starves. When nothing can run but reads
are in flight, the step waits briefly for one instead of spinning.

Prefill batching (off by default, ``prefill_batch_min_tokens``): while sequences decode, new prompts are held
until enough prompt tokens wait or the oldest has waited ``prefill_batch_max_wait_steps`` steps, so that fewer
steps carry prompt tokens.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.detokenizer import append_batch
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import RequestLimitError
from loraplex.engine.scheduler_output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from loraplex.engine.spec_decode import NgramProposer, can_speculate

IDLE_LOAD_WAIT_S = 0.02  # longest wait for an adapter read in a step that has nothing to run


class AdapterGate(Protocol):
    """What the scheduler asks about adapters (``LoRAManager`` implements it)."""

    def poll(self, waiting: Iterable) -> dict[int, str]: ...  # LoRA requests in order -> failed id: error

    def is_ready(self, adapter_id: int) -> bool: ...  # in host memory or a slot: may run now

    def is_resident(self, adapter_id: int) -> bool: ...  # holds a GPU slot

    def wait_for_load(self, timeout: float) -> bool: ...

    def take_dropped(self) -> list[int]: ...  # ids whose weights were forgotten (removed or replaced)

    def kept_adapter_ids(self) -> set[int]: ...  # pinned from code (pin_lora): each holds a slot of max_loras


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, adapters: AdapterGate | None = None):
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.samples: dict[str, list[Request]] = {}  # request_id -> its live samples
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_adapter_wait_steps = 0  # steps with nothing to run while requests waited for adapter reads
        self.adapter_wait_seconds = 0.0  # host time those steps spent waiting for a read
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run through the model
        self.last_kv_waste = 0.0
        self.adapters = adapters
        self._failed: list[tuple[str, list[Request]]] = []  # (request id, samples) failed by an adapter read
        self.prefill_held_steps = 0  # consecutive steps the prefill batching gate held waiting requests back
        self.num_prefill_held_steps = 0  # since start
        # speculative decoding (engine/spec_decode.py)
        self.proposer = None
        if config.num_speculative_tokens:
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)
        self.num_draft_tokens = 0  # draft tokens verified, since start
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_extra_tokens = 0  # tokens appended beyond one per sequence and step (accepted, before any stop)

    # ---- queue management ----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.samples:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self._check_limits(req)
        req.status = RequestStatus.WAITING
        self.samples[req.request_id] = [req]
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _check_limits(self, req: Request) -> None:
        """Refuse a request that could never run here, naming the field to change and its limit."""
        max_len = self.config.max_model_len
        n, max_tokens, num_prompt = req.sampling_params.n, req.sampling_params.max_tokens, req.num_prompt_tokens
        if n > self.config.max_num_seqs:
            raise RequestLimitError("n", f"{n} samples need {n} sequences at once; the limit is max_num_seqs "
                                    f"({self.config.max_num_seqs})", limit=self.config.max_num_seqs)
        if num_prompt >= max_len:
            raise RequestLimitError("prompt", f"the prompt has {num_prompt} tokens; the limit is {max_len - 1} "
                                    f"(max_model_len {max_len}, less one token to generate)", limit=max_len - 1)
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size  # tokens of one sequence that alone holds every KV block
        longest = min(max_len, num_prompt + (max_tokens or max_len))
        if bm.blocks_for(longest) > bm.num_blocks:
            cache = f"the {bm.num_blocks} KV blocks of {bm.block_size} ({capacity} tokens) the cache has"
            if num_prompt >= capacity:
                raise RequestLimitError("prompt", f"the prompt has {num_prompt} tokens and needs more than "
                                        f"{cache}; the limit is {capacity - 1}", limit=capacity - 1)
            asked = "the rest of the context" if max_tokens is None else str(max_tokens)
            raise RequestLimitError("max_tokens", f"a sequence of {longest} tokens (a {num_prompt}-token prompt + "
                                    f"max_tokens {asked}) needs more than {cache}; the limit for this "
                                    f"prompt is {capacity - num_prompt}", limit=capacity - num_prompt)

    def abort_request(self, request_id: str) -> list[Request]:
        """Finish every live sample of the request; returns them (empty when unknown or done)."""
        aborted = [r for r in self.samples.get(request_id, []) if not r.is_finished]
        for req in aborted:
            req.num_pending_forks = 0
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.adapters is not None:
            self._poll_adapters()
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, ScheduledRequest] = {}
        preempted: list[Request] = []

        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.finishing:  # its in-flight token ends it (overlapped steps): nothing left to compute
                i += 1
                continue
            num_tokens = len(req.token_ids)
            num_new = num_tokens - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            assert num_new > 0, "a running sequence always has a token to compute"
            drafts = self._propose(req, budget) if self.proposer is not None and num_new == 1 else None
            if drafts:
                if bm.allocate_slots(req, 1 + len(drafts)):
                    scheduled[req.seq_id] = ScheduledRequest(req, 1 + len(drafts), 1, draft_token_ids=drafts)
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
                # no blocks for the draft: the one token, as without speculation (preempting if it must)
            while not bm.allocate_slots(req, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                completes = req.num_computed_tokens + num_new == num_tokens
                scheduled[req.seq_id] = ScheduledRequest(req, num_new, (1 + req.num_pending_forks) if completes else 0)
                budget -= num_new
                i += 1

        if not preempted and self._prefill_gate_open():
            budget = self._admit_waiting(budget, scheduled, preempted)

        batch = list(scheduled.values())
        chunks = any(s.num_new_tokens != 1 for s in batch)
        if chunks:
            # one-token sequences first (stable): attention runs that leading run through the split-KV decode kernel
            # and only the rest through the varlen kernel (AttentionMetadata.num_decodes); rows are independent
            batch = [s for s in batch if s.num_new_tokens == 1] + [s for s in batch if s.num_new_tokens != 1]
        # (a speculating sequence also computes several tokens, but is no prompt chunk)
        out = SchedulerOutput(scheduled=batch, blocks_to_copy=bm.take_pending_copies(), preempted=preempted,
                              has_prompt_chunks=chunks and any(s.num_new_tokens != 1 and not s.draft_token_ids
                                                               for s in batch))
        if self.proposer is not None:
            out.num_draft_tokens = sum(len(s.draft_token_ids) for s in batch if s.draft_token_ids)
        out.lora_ids = {s.request.lora_request.lora_int_id for s in out.scheduled
                        if s.request.lora_request is not None} - {0}
        assert len(out.lora_ids) <= self.config.max_loras
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            if req.num_computed_tokens < req.num_prompt_tokens:  # a prompt chunk (decodes skip all this)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self.num_computed_prompt_tokens += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
                req.num_computed_prompt_tokens = max(req.num_computed_prompt_tokens, min(
                    req.num_prompt_tokens, req.num_computed_tokens + s.num_new_tokens))
        self.last_kv_waste = self._kv_waste(scheduled)
        self.num_steps += 1
        if not scheduled and self.waiting and self.adapters is not None:
            waited = time.monotonic()
            self.adapters.wait_for_load(IDLE_LOAD_WAIT_S)  # nothing to run: only adapter reads can change that
            self.num_adapter_wait_steps += 1
            self.adapter_wait_seconds += time.monotonic() - waited
        return out

    def _propose(self, req: Request, budget: int) -> list[int] | None:
        """A draft for a decoding sequence that may speculate: within the step's token budget, the model length and
        its max_tokens (a step emits at most the draft + 1 tokens), from the prompt-lookup proposer."""
        if (req.num_computed_tokens < req.num_prompt_tokens or req.num_pending_forks
                or not can_speculate(req.sampling_params) or req.token_ids[-1] == PLACEHOLDER_TOKEN):
            return None
        room = min(budget - 1, self.config.max_model_len - len(req.token_ids))
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        if room <= 0:
            return None
        return self.proposer.propose(req.token_ids, room, key=req.seq_id) or None

    def _prefill_gate_open(self) -> bool:
        """Prefill batching (``prefill_batch_min_tokens``): may waiting requests be admitted this step? Always
        when it is off, nothing waits, fewer than ``prefill_batch_min_running`` sequences run (at low load a
        held prompt waits for nothing), or a waiting request outranks a running one; else once enough prompt
        tokens wait or the gate has been shut ``prefill_batch_max_wait_steps`` steps in a row."""
        cfg = self.config
        if cfg.prefill_batch_min_tokens <= 0 or not self.waiting or not self.running or \
                len(self.running) < cfg.prefill_batch_min_running or \
                self.waiting[0].priority < self.running[-1].priority:
            self.prefill_held_steps = 0
            return True
        waiting_tokens = 0
        for req in self.waiting:  # stops as soon as the threshold is reached
            waiting_tokens += req.num_tokens - req.num_computed_tokens
            if waiting_tokens >= cfg.prefill_batch_min_tokens:
                self.prefill_held_steps = 0
                return True
        if self.prefill_held_steps + 1 >= cfg.prefill_batch_max_wait_steps:
            self.prefill_held_steps = 0
            return True
        self.prefill_held_steps += 1
        self.num_prefill_held_steps += 1
        return False

    def _poll_adapters(self) -> None:
        for adapter_id in self.adapters.take_dropped():
            # removed or replaced: its cached blocks hold KV of weights no request will run with again
            self.block_manager.forget_adapter(adapter_id)
        failures = self.adapters.poll(r.lora_request for r in self.waiting if r.lora_id)
        if not failures:
            return
        for req in [r for r in self.waiting if r.lora_id in failures]:
            if req.is_finished:
                continue  # a sibling sample already failed it
            samples = [r for r in self.samples.get(req.request_id, []) if not r.is_finished]
            for sample in samples:
                sample.num_pending_forks = 0
                self.finish_request(sample, RequestStatus.FINISHED_ERROR, error=failures[req.lora_id])
            self._failed.append((req.request_id, samples))

    def take_failed(self) -> list[tuple[str, list[Request]]]:
        """Requests failed by an adapter read since the last call: (request id, its samples, now finished)."""
        failed, self._failed = self._failed, []
        return failed

    def _admit_waiting(self, budget: int, scheduled: dict[int, ScheduledRequest],
                       preempted: list[Request]) -> int:
        bm, cfg, adapters = self.block_manager, self.config, self.adapters
        if self.waiting and len(self.running) >= cfg.max_num_seqs and \
                self.running[-1].priority <= self.waiting[0].priority:
            return budget  # full, and no waiting request outranks the running ones: nothing can be admitted
        active_loras = {r.lora_id for r in self.running if r.lora_id}
        if adapters is not None:  # pinned adapters hold slots as running ones do
            active_loras |= adapters.kept_adapter_ids()
        passed_over: list[Request] = []
        order = self._waiting_order(active_loras, passed_over) if adapters is not None else list(self.waiting)
        admitted_ahead = False  # some request admitted ahead of one passed over
        try:
            for req in order:
                if budget <= 0:
                    break
                if req.lora_id and adapters is not None and not adapters.is_ready(req.lora_id):
                    continue  # its adapter is still being read: keeps its place, blocks nobody
                if req.lora_id and req.lora_id not in active_loras and len(active_loras) >= cfg.max_loras:
                    req.wait_steps += 1
                    if req.wait_steps >= cfg.lora_max_wait_steps:
                        break  # aged: nothing behind it is admitted until its adapter fits
                    continue
                num_seqs = 1 + req.num_pending_forks
                while len(self.running) + num_seqs > cfg.max_num_seqs:
                    budget = self._preempt_lower_priority(req, scheduled, preempted, budget)
                    if budget is None:
                        return 0
                cached = bm.find_cached_prefix(req)
                num_new = min(req.num_tokens - len(cached) * bm.block_size, budget)
                while not bm.allocate_slots(req, num_new, cached):
                    budget = self._preempt_lower_priority(req, scheduled, preempted, budget)
                    if budget is None:
                        return 0
                    num_new = min(req.num_tokens - len(cached) * bm.block_size, budget)
                if req.num_preemptions == 0 and req.num_output_tokens == 0:
                    req.num_cached_tokens = len(cached) * bm.block_size
                    bm.record_prefix_query(req.num_prompt_tokens, req.num_cached_tokens)
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                req.wait_steps = 0
                bisect.insort(self.running, req, key=lambda r: r.sort_key)
                if req.lora_id:
                    active_loras.add(req.lora_id)
                scheduled[req.seq_id] = self._scheduled(req, num_new)
                budget -= num_new
                admitted_ahead = admitted_ahead or bool(passed_over)
            return budget
        finally:
            if admitted_ahead:
                for req in passed_over:
                    if req.status is not RequestStatus.RUNNING:
                        req.wait_steps += 1

    def _waiting_order(self, active_loras: set[int], passed_over: list[Request]) -> Iterator[Request]:
        """Waiting requests in admission order, per priority.

        First, in FCFS order, those that need no new adapter: base requests, requests whose adapter runs
        (``active_loras`` grows as requests are admitted), requests whose adapter is still being read (they keep
        their place and block nobody) and aged ones. Without grouping, requests whose adapter holds a GPU slot
        count as needing none too. Then the others (collected in ``passed_over``) grouped by adapter, in the order
        of each adapter's oldest request: adapters that run by then first, then those holding a slot, then the
        rest (without grouping: FCFS). Grouping (``lora_grouping``, off by default) applies while GPU slots cannot
        run out (``max_loras >= max_num_seqs``): deferring an adapter then never costs a later step its batch, and
        the requests sharing one are batched together."""
        cfg, adapters = self.config, self.adapters
        grouping = cfg.lora_grouping and cfg.max_loras >= cfg.max_num_seqs
        max_wait = cfg.lora_group_max_skips if grouping else cfg.lora_max_wait_steps
        resident: dict[int, list[Request]] = {}  # adapter id -> its held requests (FCFS of the first)
        cold: dict[int, list[Request]] = {}
        priority = None
        for req in list(self.waiting):
            if req.priority != priority:
                yield from self._held_in_order(resident, cold, active_loras)
                priority = req.priority
            lora_id = req.lora_id
            if (not lora_id or lora_id in active_loras or req.wait_steps >= max_wait
                    or not adapters.is_ready(lora_id)):
                yield req
            elif adapters.is_resident(lora_id):
                if not grouping:
                    yield req
                    continue
                resident.setdefault(lora_id, []).append(req)
                passed_over.append(req)
            else:  # without grouping, all in one list (FCFS)
                cold.setdefault(lora_id if grouping else 0, []).append(req)
                passed_over.append(req)
        yield from self._held_in_order(resident, cold, active_loras)

    @staticmethod
    def _held_in_order(resident: dict[int, list[Request]], cold: dict[int, list[Request]],
                       active_loras: set[int]) -> Iterator[Request]:
        """Empties both dicts: groups whose adapter runs now, then resident, then cold ones, each FCFS."""
        groups = [(lid, resident) for lid in resident] + [(lid, cold) for lid in cold]
        running = [g for g in groups if g[0] in active_loras]
        for lid, held in running + [g for g in groups if g[0] not in active_loras]:
            yield from held.pop(lid)

    def _preempt_lower_priority(self, req: Request, scheduled: dict[int, ScheduledRequest],
                                preempted: list[Request], budget: int) -> int | None:
        """Preempt the worst running sequence if it ranks below ``req``; None when there is none."""
        if not self.running or self.running[-1].priority <= req.priority:
            return None
        victim = self.running.pop()
        gone = scheduled.pop(victim.seq_id, None)
        if gone is not None:
            budget += gone.num_new_tokens
        self._preempt(victim)
        preempted.append(victim)
        return budget

    @staticmethod
    def _scheduled(req: Request, num_new: int) -> ScheduledRequest:
        completes = req.num_computed_tokens + num_new == req.num_tokens
        return ScheduledRequest(req, num_new, (1 + req.num_pending_forks) if completes else 0)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free_blocks(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _kv_waste(self, scheduled: dict[int, ScheduledRequest]) -> float:
        """Allocated slots not holding a token / allocated slots. Block tables are sized exactly, so only
        the last block of each sequence can be partly empty (a block shared by forks counts once)."""
        bm = self.block_manager
        allocated = bm.num_used_blocks * bm.block_size
        if not allocated:
            return 0.0
        live = [r for r in self.running if r.block_ids]
        get = scheduled.get
        slots = [r.num_computed_tokens + (s.num_new_tokens if (s := get(r.seq_id)) else 0) for r in live]
        lasts = [len(r.block_ids) for r in live]
        last_ids = [r.block_ids[-1] for r in live]
        bs = bm.block_size
        filled = [n - (k - 1) * bs for n, k in zip(slots, lasts)]
        if len(set(last_ids)) == len(last_ids):
            return sum(bs - f for f in filled) / allocated
        filled_last: dict[int, int] = {}
        for last, f in zip(last_ids, filled):
            filled_last[last] = max(filled_last.get(last, 0), f)
        return sum(bs - f for f in filled_last.values()) / allocated

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results. Returns the samples that got a token or finished (forks included)."""
        bm = self.block_manager
        touched: list[Request] = []
        now = time.monotonic()
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        prompt_logprobs = result.prompt_logprobs
        sampled_ids, sampled_lps, logprobs_of = result.sampled_token_ids, result.sampled_logprobs, result.logprobs
        registers = bm.enable_prefix_caching
        to_detokenize: list[Request] = []
        to_check: list[Request] = []
        block_size = bm.block_size
        for s in out.scheduled:
            req = s.request
            if req.status is not running:
                continue  # aborted while the step ran
            if s.draft_token_ids:
                self._apply_verified(req, s, sampled_ids[req.seq_id], sampled_lps.get(req.seq_id), now)
                touched.append(req)
                continue
            req.num_computed_tokens += s.num_new_tokens
            if prompt_logprobs:
                chunk_logprobs = prompt_logprobs.get(req.seq_id)
                if chunk_logprobs:
                    if not req.prompt_logprobs:
                        req.prompt_logprobs.append(None)
                    req.prompt_logprobs.extend(chunk_logprobs)
            if registers and req.num_computed_tokens // block_size > req.num_registered_blocks:
                bm.register_full_blocks(req)
            if s.num_samples == 0:
                continue
            token_ids = sampled_ids[req.seq_id]
            assert len(token_ids) == s.num_samples
            logprobs = logprobs_of.get(req.seq_id) if logprobs_of else None
            sampled_logprobs = sampled_lps.get(req.seq_id)
            if s.num_samples == 1 and logprobs is None:  # the common decode: one token, no top-N logprobs
                req.token_ids.append(token_ids[0])
                if req.detokenizer is not None:
                    to_detokenize.append(req)
                if sampled_logprobs is not None:
                    req.cumulative_logprob += sampled_logprobs[0]
                if req.first_token_time is None:
                    req.first_token_time = now
                to_check.append(req)
                touched.append(req)
                continue
            samples = [req] + [self._fork(req, i) for i in range(1, s.num_samples)]
            req.num_pending_forks = 0
            for k, (sample, token_id) in enumerate(zip(samples, token_ids)):
                self.apply_token(sample, token_id, sampled_logprobs[k] if sampled_logprobs is not None else None,
                                 logprobs[k] if logprobs is not None else None, now)
                touched.append(sample)
        # the common case's text, all requests in one tokenizer call, then its stop checks (stop strings
        # read that text)
        if to_detokenize:
            append_batch([r.detokenizer for r in to_detokenize], [r.token_ids[-1] for r in to_detokenize])
        for req in to_check:
            status = req.check_stop(max_model_len)
            if status is not None:
                self._finish(req, status)
        return touched

    def _apply_verified(self, req: Request, s: ScheduledRequest, token_ids: list[int], logprobs: list[float] | None,
                        now: float) -> None:
        """A speculating sequence's step: its newest token and the accepted draft tokens are computed (their KV is
        valid; the rejected ones' slots are overwritten later), then the tokens are appended one by one with their
        stop checks (a stop inside the accepted run drops the rest)."""
        accepted = len(token_ids) - 1
        assert 0 <= accepted <= len(s.draft_token_ids) and token_ids[:accepted] == s.draft_token_ids[:accepted]
        self.num_draft_tokens += len(s.draft_token_ids)
        self.num_accepted_tokens += accepted
        bm = self.block_manager
        req.num_computed_tokens += 1 + accepted
        if bm.enable_prefix_caching and req.num_computed_tokens // bm.block_size > req.num_registered_blocks:
            # the blocks the accepted tokens filled are keyed by those tokens, not yet appended (and registered even
            # if a stop among them ends the sequence: their KV is that of those tokens)
            bm.register_full_blocks(req, req.token_ids + token_ids[:accepted])
        bm.trim(req, req.num_computed_tokens + 1)  # blocks taken for rejected draft tokens only
        for k, token_id in enumerate(token_ids):
            self.apply_token(req, token_id, logprobs[k] if logprobs is not None else None, None, now)
            self.num_extra_tokens += k > 0
            if req.is_finished:
                break

    def apply_token(self, sample: Request, token_id: int, sampled_logprob: float | None, logprobs_entry,
                    now: float) -> None:
        """One sampled token for one sequence: append it (and its text), its logprobs, the first-token time,
        then the stop checks (finishing the sequence when one holds)."""
        sample.append_token(token_id)
        if sampled_logprob is not None:
            sample.cumulative_logprob += sampled_logprob
        if logprobs_entry is not None:
            sample.logprobs.append(logprobs_entry)
        if sample.first_token_time is None:
            sample.first_token_time = now
        status = sample.check_stop(self.config.max_model_len)
        if status is not None:
            self._finish(sample, status)

    def _fork(self, parent: Request, index: int) -> Request:
        child = parent.fork(index)
        if parent.detokenizer is not None:
            child.detokenizer = parent.detokenizer.fork()
        self.block_manager.fork(parent, child)
        self.samples[parent.request_id].append(child)
        bisect.insort(self.running, child, key=lambda r: r.sort_key)
        return child

    def finish_request(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        req.error = error
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        assert status.finished
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.block_manager.free_blocks(req)
        if self.proposer is not None:
            self.proposer.forget(req.seq_id)
        req.status = status
        req.finished_time = time.monotonic()
        live = self.samples.get(req.request_id)
        if live is not None and all(r.is_finished for r in live) and not any(r.num_pending_forks for r in live):
            del self.samples[req.request_id]
