"""The host side of sampling a step: which hidden rows to sample, the sampler call, and the results.

``StepSampler(out, batch, hidden)`` takes the final hidden states of a step (eager or a CUDA graph's first
B rows), computes logits only for the rows that are sampled (each sequence's last new token, repeated for
a fork's n samples) and for the prompt positions whose logprobs were asked for, samples, and turns the
result into a ``ModelRunnerOutput`` with one device->host copy for the tokens and their logprobs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from loraplex.engine.request import TokenLogprobs
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from loraplex.engine.spec_decode import verify
from loraplex.engine.step_inputs import StepBatch


def _add_logprobs(result: ModelRunnerOutput, seq_ids: list[int], counts: list[int], num_tops: list[int | None],
                  token_ids: list[int], lps: list[float], ranks: list[int], top_ids: list | None,
                  top_lps: list | None) -> None:
    """``result.logprobs`` of the sequences that asked for them (``num_tops[i]`` not None): sequence i owns
    the next ``counts[i]`` sampled rows (n rows for a fork); ``top_ids``/``top_lps`` are None when no
    row asked for a top-N."""
    i = 0
    for q, c, num_top in zip(seq_ids, counts, num_tops):
        if num_top is not None:
            result.logprobs[q] = [
                TokenLogprobs(token_ids[k], lps[k], ranks[k], top_ids[k][:num_top] if num_top else [],
                              top_lps[k][:num_top] if num_top else [])
                for k in range(i, i + c)]
        i += c


class _Ring:
    """``size`` pinned host buffers (on CUDA) handed out in turn, made on first use. A buffer comes round again
    only ``size`` steps later: by then the host has waited for the steps whose copies could still use it."""

    def __init__(self, size: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.size, self.shape, self.dtype, self.pin = size, shape, dtype, pin
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def next(self) -> torch.Tensor:
        if not self._buffers:
            self._buffers = [torch.zeros(self.shape, dtype=self.dtype, pin_memory=self.pin) for _ in range(self.size)]
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % self.size
        return buf


class PendingSample:
    """A step's sampling, launched: ``result()`` waits for its tokens on the host.

    ``tokens`` (device, [R] int64) holds the sampled tokens in the order of ``row_of`` (seq_id -> index),
    so the next step can read a token on the device before the host has it (overlapped steps). A pending
    sample whose result was computed synchronously (``tokens`` None) cannot feed a next step that way."""

    def __init__(self, result: ModelRunnerOutput | None = None, tokens: torch.Tensor | None = None,
                 row_of: dict[int, int] | None = None, host: torch.Tensor | None = None,
                 event: torch.cuda.Event | None = None, seq_ids: list[int] | None = None,
                 num_top: list[int | None] | None = None):
        self._result = result
        self.tokens = tokens
        self.row_of = row_of or {}
        self._host, self._event, self._seq_ids = host, event, seq_ids
        # with logprobs: each row's top-N (None: the request asked for none); rows 2.. of the host buffer
        # hold the ranks, then the top ids and top logprobs (width N each)
        self._num_top = num_top

    @property
    def is_async(self) -> bool:
        return self.tokens is not None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            n = len(self._seq_ids)
            packed = self._host.numpy()  # [rows, n]
            token_ids = packed[0].astype(np.int64).tolist()
            lps = packed[1].tolist()
            self._result = ModelRunnerOutput(
                sampled_token_ids={q: [t] for q, t in zip(self._seq_ids, token_ids)},
                sampled_logprobs={q: [lp] for q, lp in zip(self._seq_ids, lps)})
            if self._num_top is not None:
                width = (packed.shape[0] - 3) // 2
                _add_logprobs(self._result, self._seq_ids, [1] * n, self._num_top, token_ids, lps,
                              packed[2].astype(np.int64).tolist(), packed[3:3 + width].T.astype(np.int64).tolist(),
                              packed[3 + width:].T.tolist())
            self._host = None  # its ring slot may be reused
        return self._result


class StepSampler:
    RING = 4  # pinned buffers per ring: steps whose copies may still be in flight

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], sampler: Sampler,
                 device: torch.device, max_rows: int = 0):
        self.compute_logits = compute_logits  # [N, H] hidden -> [N, V] float32 logits
        self.sampler = sampler
        self.device = torch.device(device)
        self._prompt_arrays: dict[int, np.ndarray] = {}  # seq_id -> prompt ids, for penalized requests
        self._max_cached_prompts = 4096
        self.max_rows = max_rows
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        # tokens + logprobs to the host; flat, so that a step's [2, n] destination is one contiguous block: a
        # non-blocking copy into a strided view of pinned memory (host[:, :n] of a [2, max_rows] buffer) goes
        # through a staging buffer and waits for the stream, which made every overlapped step synchronous
        self._results = _Ring(self.RING, (2 * max_rows,), torch.float64, pin)
        self._indices = _Ring(self.RING, (max_rows,), torch.int64, pin)  # sampled-row indices to the device

    def launch(self, out: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor,
               inflight: tuple[dict[int, int], torch.Tensor] | None = None) -> PendingSample:
        """Sample the step without waiting for the tokens when the step allows it: one sample per
        sequence (no fork), no prompt logprobs. Otherwise the synchronous path, already finished.

        ``inflight`` (overlapped steps): seq_id -> index into the previous step's device tokens, for the
        sequences whose newest token is still a placeholder (penalties count it on the device)."""
        counts = batch.sample_counts
        flags = batch.sampler_flags
        simple = (self.max_rows and not batch.any_prompt_logprobs and max(counts, default=0) <= 1
                  and not out.num_draft_tokens)
        row_idx = batch.last_token_rows[np.asarray(counts, dtype=bool)] if simple else None
        if not simple or not 0 < row_idx.size <= self.max_rows:
            return PendingSample(self(out, batch, hidden, inflight))
        reqs = [s.request for s, c in zip(out.scheduled, counts) if c]
        logits = self.compute_logits(self._gather_rows(hidden, row_idx))
        src_of, inflight_tokens = inflight if inflight is not None else ({}, None)
        sampled = self.sampler.sample(logits, [r.sampling_params for r in reqs],
                                      lambda: [SampleRow(r.sampling_params, r.index, r.num_output_tokens,
                                                         self._prompt_array(r), r.output_token_ids,
                                                         src_of.get(r.seq_id), r.bad_words_token_ids,
                                                         r.min_tokens_ban, (r.seq_id, r.index))
                                               for r in reqs],
                                      flags, inflight_tokens)
        n = row_idx.size
        num_top = None
        if sampled.ranks is None:
            host = self._results.next()[:2 * n].view(2, n)
            parts = [sampled.token_ids, sampled.logprobs]
        else:  # logprobs asked for: ranks and the top-N go to the host in the same copy
            num_top = [r.sampling_params.logprobs for r in reqs]
            top_ids, top_lps = sampled.top_ids, sampled.top_logprobs
            if top_ids is None:
                top_ids = top_lps = sampled.logprobs.new_empty(n, 0)
            parts = [sampled.token_ids, sampled.logprobs, sampled.ranks, *top_ids.T, *top_lps.T]
            host = torch.empty(len(parts), n, dtype=torch.float64, pin_memory=self._results.pin)  # cached pinned
        packed = torch.stack([p.double() for p in parts])  # float64 holds any token id and rank exactly
        event = None
        assert host.is_contiguous()  # see _results
        if self.device.type == "cuda":
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(packed)
        seq_ids = [r.seq_id for r in reqs]
        return PendingSample(tokens=sampled.token_ids, row_of={q: i for i, q in enumerate(seq_ids)}, host=host,
                             event=event, seq_ids=seq_ids, num_top=num_top)

    def _gather_rows(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """``hidden[rows]``. A pure-decode step samples rows 0..n-1: a view, no index copy and no gather
        kernel. Otherwise the index reaches the device from a ring of pinned buffers (a copy from pageable
        memory may wait for the stream; a ring slot is reused only after the steps that could still be reading
        it have finished)."""
        n = rows.size
        if n and rows[0] == 0 and rows[-1] == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
            return hidden[:n]
        if not self._indices.pin or n > self.max_rows:
            return hidden[torch.from_numpy(rows).to(self.device, non_blocking=True)]
        staging = self._indices.next()[:n]
        staging.numpy()[:] = rows
        return hidden[staging.to(self.device, non_blocking=True)]

    def __call__(self, out: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor,
                 inflight: tuple[dict[int, int], torch.Tensor] | None = None) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        counts = batch.sample_counts
        if out.num_draft_tokens:  # speculating sequences sample their own rows (spec_decode.verify)
            counts = [0 if s.draft_token_ids else c for s, c in zip(out.scheduled, counts)]
        sampled = [s for s, c in zip(out.scheduled, counts) if c]  # requests sampling this step
        row_idx = batch.last_token_rows.repeat(counts)  # hidden rows to sample from (n rows for a fork)
        prompt_rows = self._prompt_logprob_rows(out, batch) if batch.any_prompt_logprobs else []
        spec = [(s, row) for s, row in zip(out.scheduled, batch.last_token_rows.tolist()) if s.draft_token_ids]
        spec_rows = [np.arange(row - len(s.draft_token_ids), row + 1, dtype=np.int64) for s, row in spec]
        if not row_idx.size and not prompt_rows and not spec:
            return result
        all_rows = np.concatenate([row_idx, *spec_rows] + [np.asarray(rr, dtype=np.int64) for _, rr, _ in prompt_rows])
        logits = self.compute_logits(self._gather_rows(hidden, all_rows))
        if row_idx.size:
            self._collect_samples(sampled, logits[:row_idx.size], result, batch.sampler_flags, inflight)
        num_spec = sum(r.size for r in spec_rows)
        if spec:
            verified = verify(logits[row_idx.size:row_idx.size + num_spec], [s.draft_token_ids for s, _ in spec],
                              [s.request.sampling_params for s, _ in spec], self.sampler.generator)
            for (s, _), ids, lps in zip(spec, verified.token_ids, verified.logprobs):
                result.sampled_token_ids[s.request.seq_id] = ids
                result.sampled_logprobs[s.request.seq_id] = lps
        if prompt_rows:
            self._collect_prompt_logprobs(out, logits[row_idx.size + num_spec:], prompt_rows, result)
        return result

    @staticmethod
    def _prompt_logprob_rows(out: SchedulerOutput, batch: StepBatch) -> list[tuple[int, list[int], list[int]]]:
        """(seq_id, hidden rows, target ids) of the prompt tokens whose logprobs this step computes."""
        prompt_rows = []
        for s, start in zip(out.scheduled, (batch.last_token_rows + 1 - batch.query_lens).tolist()):
            if not s.wants_prompt_logprobs:
                continue
            req = s.request
            done = max(len(req.prompt_logprobs) - 1, 0)
            first = max(req.num_computed_tokens, done)
            end = min(req.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
            if end > first:
                base = start - req.num_computed_tokens
                prompt_rows.append((req.seq_id, list(range(base + first, base + end)),
                                    req.token_ids[first + 1:end + 1]))
        return prompt_rows

    def _prompt_array(self, req) -> np.ndarray:
        """The request's prompt as an int64 array, made once (penalties count the prompt every step)."""
        arr = self._prompt_arrays.get(req.seq_id)
        if arr is None:
            if len(self._prompt_arrays) >= self._max_cached_prompts:
                self._prompt_arrays.clear()  # finished requests' arrays; live ones are rebuilt on demand
            arr = self._prompt_arrays[req.seq_id] = np.asarray(req.prompt_token_ids, dtype=np.int64)
        return arr

    def _collect_samples(self, sampled: list, logits: torch.Tensor, result: ModelRunnerOutput, flags: int,
                         inflight: tuple[dict[int, int], torch.Tensor] | None = None) -> None:
        src_of, inflight_tokens = inflight if inflight is not None else ({}, None)
        reqs = [s.request for s in sampled]
        counts = [s.num_samples for s in sampled]
        if len(reqs) == logits.shape[0]:  # one sample per request (no fork this step)
            sample_reqs, sample_index = reqs, None
        else:
            sample_reqs = [r for r, c in zip(reqs, counts) for _ in range(c)]
            sample_index = [r.index + k for r, c in zip(reqs, counts) for k in range(c)]

        def rows() -> list[SampleRow]:
            index = sample_index or [r.index for r in sample_reqs]
            return [SampleRow(r.sampling_params, i, r.num_output_tokens, self._prompt_array(r), r.output_token_ids,
                              src_of.get(r.seq_id), r.bad_words_token_ids, r.min_tokens_ban, (r.seq_id, i))
                    for r, i in zip(sample_reqs, index)]

        out = self.sampler.sample(logits, [r.sampling_params for r in sample_reqs], rows, flags, inflight_tokens)
        # one device->host copy for the tokens and their logprobs (float64 holds any token id exactly)
        packed = torch.stack((out.token_ids.double(), out.logprobs.double())).cpu().numpy()
        token_ids = packed[0].astype(np.int64).tolist()
        lps = packed[1].tolist()
        seq_ids = [r.seq_id for r in reqs]
        if sample_index is None:
            result.sampled_token_ids = {q: [t] for q, t in zip(seq_ids, token_ids)}
            result.sampled_logprobs = {q: [lp] for q, lp in zip(seq_ids, lps)}
        else:
            ends = np.cumsum(counts).tolist()
            result.sampled_token_ids = {q: token_ids[e - c:e] for q, c, e in zip(seq_ids, counts, ends)}
            result.sampled_logprobs = {q: lps[e - c:e] for q, c, e in zip(seq_ids, counts, ends)}
        if out.ranks is None:
            return
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        _add_logprobs(result, seq_ids, counts, [r.sampling_params.logprobs for r in reqs], token_ids, lps,
                      out.ranks.tolist(), top_ids, top_lps)

    def _collect_prompt_logprobs(self, out, logits, prompt_rows, result: ModelRunnerOutput) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor([t for _, _, tt in prompt_rows for t in tt], device=self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
        num_top = {s.request.seq_id: s.request.sampling_params.prompt_logprobs for s in out.scheduled}
        width = max(num_top[seq_id] for seq_id, _, _ in prompt_rows)
        top_lps, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0].long())
        chosen, top_lps, top_ids, tgt = chosen.tolist(), top_lps.tolist(), top_ids.tolist(), targets.tolist()
        r = 0
        for seq_id, hidden_rows, _ in prompt_rows:
            n = num_top[seq_id]
            result.prompt_logprobs[seq_id] = [
                TokenLogprobs(tgt[k], chosen[k], ranks[k], top_ids[k][:n], top_lps[k][:n])
                for k in range(r, r + len(hidden_rows))]
            r += len(hidden_rows)
