"""Sampling from a batch of logits rows: allowed_token_ids, bad_words and logit_bias, penalties, temperature,
top-k, top-p, min-p, per-row seeds, and logprobs of the raw model distribution (vLLM's default: before any of
those).

A row with a seed draws its noise from a generator seeded by (seed, sample index, output position), so a
seeded request gets the same tokens whatever else is in the batch, and after preemption too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.penalty_state import PenaltyState, token_counts
from loraplex.engine.sampling_params import (
    SAMPLE_BAD_WORDS,
    SAMPLE_LOGIT_BIAS,
    SAMPLE_LOGPROBS,
    SAMPLE_MIN_P,
    SAMPLE_MIN_TOKENS,
    SAMPLE_PENALTIES,
    SAMPLE_RANDOM,
    SAMPLE_SEEDED,
    SAMPLE_TOP_K_P,
    SamplingParams,
)

_MASK = float("-inf")
_BIASED = SAMPLE_LOGIT_BIAS | SAMPLE_BAD_WORDS | SAMPLE_MIN_TOKENS
# features that read ``SampleRow``s
_ROW_DETAILS = SAMPLE_PENALTIES | SAMPLE_SEEDED | SAMPLE_BAD_WORDS | SAMPLE_MIN_TOKENS


@dataclass
class SampleRow:
    params: SamplingParams
    index: int  # sample index (of n)
    num_output_tokens: int  # before this token
    prompt_token_ids: Sequence[int]  # a list, or an int64 numpy array
    output_token_ids: Sequence[int]
    # overlapped steps: the last output token is still a placeholder; the real one is this index of the
    # ``inflight_tokens`` device tensor passed to ``sample``
    inflight_src: int | None = None
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # the request's ``bad_words`` as token sequences
    # the tokens that would end the sequence (EOS unless ignore_eos, stop_token_ids): banned while
    # num_output_tokens < params.min_tokens, as in vLLM
    stop_token_ids: Sequence[int] = ()
    # (seq_id, sample index): lets the penalties keep this row's token counts on the device across steps
    # (``penalty_state``); None counts them from the token lists again
    key: tuple[int, int] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32: raw logprob of each sampled token
    ranks: torch.Tensor | None  # [R] int64 (only when logprobs were asked for)
    top_ids: torch.Tensor | None  # [R, N]
    top_logprobs: torch.Tensor | None  # [R, N]


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync: ``torch.tensor(values, device=cuda)`` copies
    with ``non_blocking=False``, which waits for every kernel queued before it (with overlapped steps, the whole
    previous step), so a batch with top-p or penalties would stall the queue every step. The list goes through
    numpy (a third of ``torch.tensor``'s time for a few hundred values)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    host = torch.from_numpy(np.asarray(values, dtype=np_dtype)) if np_dtype else torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True)


def row_seed(seed: int, index: int, position: int) -> int:
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + position * 0xC2B2AE3D) % (1 << 63)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # id(params) -> a live request's allowed_token_ids and logit_bias as arrays (``_arrays_of``)
        self._bias_arrays: dict[int, tuple[np.ndarray | None, np.ndarray, np.ndarray]] = {}
        self._penalties: PenaltyState | None = None  # rows with a key: their penalty counts across steps

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        return self.sample(logits, [r.params for r in rows], lambda: rows)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               get_rows: Callable[[], list[SampleRow]], flags: int | None = None,
               inflight_tokens: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per logits row (``params[i]`` for row i). ``get_rows`` builds the per-row
        details (sample index, position, token lists) and is only called when a row uses penalties, a
        seed or bad_words, so a batch without them costs no per-row Python beyond reading its flags. ``flags``
        (the OR of the rows' ``sampler_flags``, or of a superset's) saves that pass when the caller has it."""
        # logits: [R, V] float32
        if flags is None:
            flags = 0
            for p in params:
                flags |= p.sampler_flags
        if not flags & (SAMPLE_RANDOM | SAMPLE_PENALTIES | SAMPLE_LOGPROBS | _BIASED):
            # all greedy, nothing else asked: the argmax and its logprob (max - logsumexp), three ops
            top, token_ids = logits.max(dim=-1)
            return SamplerOutput(token_ids, top - torch.logsumexp(logits, dim=-1), None, None, None)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        rows = get_rows() if flags & _ROW_DETAILS else None
        if flags & _BIASED:
            logits = self._apply_bias(logits, params, rows, inflight_tokens)
        if flags & SAMPLE_PENALTIES:
            logits = self._apply_penalties(logits, rows, inflight_tokens)
        token_ids = logits.argmax(dim=-1)
        if flags & SAMPLE_RANDOM:
            greedy = to_device([p.greedy for p in params], torch.bool, self.device)
            token_ids = torch.where(greedy, token_ids, self._sample(logits, params, rows, flags))
        sampled_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        ranks = top_ids = top_logprobs = None
        if flags & SAMPLE_LOGPROBS:
            num_top = max((p.logprobs or 0) for p in params)
            ranks = (raw_logprobs > sampled_logprobs[:, None]).sum(dim=-1) + 1
            if num_top:
                top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, ranks, top_ids, top_logprobs)

    def _apply_bias(self, logits: torch.Tensor, params: list[SamplingParams], rows: list[SampleRow] | None,
                    inflight_tokens: torch.Tensor | None) -> torch.Tensor:
        """allowed_token_ids, bad_words and logit_bias (vLLM applies them before penalties) as one additive bias
        of the rows that use any: -inf where a row may not sample, its logit_bias values elsewhere."""
        idx = [i for i, p in enumerate(params) if p.sampler_flags & _BIASED]
        dev, vocab = self.device, logits.shape[1]
        bias = torch.zeros(len(idx), vocab, device=dev)
        flat = bias.view(-1)  # position j * vocab + token: token of the j-th biased row
        masked, keep, bias_pos, bias_values = [], [], [], []
        for j, i in enumerate(idx):
            p = params[i]
            if p.sampler_flags & SAMPLE_LOGIT_BIAS:
                allowed, bias_ids, values = self._arrays_of(p)
                if allowed is not None:
                    masked.append(j)
                    keep.append(allowed + j * vocab)
                if values.size:
                    bias_pos.append(bias_ids + j * vocab)
                    bias_values.append(values)
        if masked:
            bias.index_fill_(0, to_device(masked, torch.int64, dev), _MASK)
            flat.index_fill_(0, to_device(np.concatenate(keep), torch.int64, dev), 0.0)
        if bias_pos:  # one entry per (row, token): the adds do not collide
            flat.index_add_(0, to_device(np.concatenate(bias_pos), torch.int64, dev),
                            to_device(np.concatenate(bias_values), torch.float32, dev))
        if rows is not None:
            self._ban_bad_words(flat, vocab, [rows[i] for i in idx], inflight_tokens)
            early = [j * vocab + t for j, i in enumerate(idx) if rows[i].num_output_tokens < params[i].min_tokens
                     for t in rows[i].stop_token_ids]
            if early:  # min_tokens not reached: nothing that would end the sequence may be sampled
                flat.index_fill_(0, to_device(early, torch.int64, dev), _MASK)
        rows_t = to_device(idx, torch.int64, dev)
        return logits.index_copy(0, rows_t, logits.index_select(0, rows_t) + bias)

    def _arrays_of(self, p: SamplingParams) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(allowed ids without repeats or None, logit_bias ids, logit_bias values) of a request's params, made on
        its first step (a long allowed_token_ids list is not turned into an array again every step) and dropped
        when the params object goes away (so an id is never reused while its entry is there)."""
        arrays = self._bias_arrays.get(id(p))
        if arrays is None:
            allowed = None if p.allowed_token_ids is None else np.unique(np.asarray(p.allowed_token_ids,
                                                                                    dtype=np.int64))
            lb = p.logit_bias or {}
            arrays = (allowed, np.fromiter(lb.keys(), dtype=np.int64, count=len(lb)),
                      np.fromiter(lb.values(), dtype=np.float32, count=len(lb)))
            self._bias_arrays[id(p)] = arrays
            weakref.finalize(p, self._bias_arrays.pop, id(p), None)
        return arrays

    def _ban_bad_words(self, flat: torch.Tensor, vocab: int, rows: list[SampleRow],
                       inflight_tokens: torch.Tensor | None) -> None:
        """-inf into ``flat`` (the biased rows' [R' * V] bias) for each bad word's last token where the output ends
        with the word's other tokens (always for a one-token word). The output tokens count, not the prompt's,
        as in vLLM. A row whose newest output token is still in flight matches the rest of the prefix on the host
        and that token on the device, against ``inflight_tokens``."""
        always, late_pos, late_src, late_want = [], [], [], []
        for j, r in enumerate(rows):
            if not r.bad_words_token_ids:
                continue
            out = r.output_token_ids
            n = len(out)
            for word in r.bad_words_token_ids:
                k = len(word) - 1  # prefix length
                pos = j * vocab + word[-1]
                if k == 0:
                    always.append(pos)
                elif k > n:
                    continue
                elif r.inflight_src is None:
                    if tuple(out[n - k:]) == tuple(word[:-1]):
                        always.append(pos)
                elif tuple(out[n - k:n - 1]) == tuple(word[:k - 1]):  # out[-1] is the placeholder
                    late_pos.append(pos)
                    late_src.append(r.inflight_src)
                    late_want.append(word[k - 1])
        dev = self.device
        if always:
            flat.index_fill_(0, to_device(always, torch.int64, dev), _MASK)
        if late_pos:
            assert inflight_tokens is not None, "a row's token is in flight but the step has no in-flight tokens"
            pos, src, want = to_device([late_pos, late_src, late_want], torch.int64, dev)
            hit = inflight_tokens.index_select(0, src) == want
            flat.index_put_((pos,), torch.where(hit, _MASK, 0.0), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow],
                         inflight_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's order: repetition (prompt and output tokens), then frequency and presence (output).
        A row whose newest output token is still in flight counts it from ``inflight_tokens`` on the device."""
        idx = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 or r.params.presence_penalty
               or r.params.frequency_penalty]
        if not idx:
            return logits
        dev, vocab = self.device, logits.shape[1]
        params = [rows[i].params for i in idx]
        keys = [rows[i].key for i in idx]
        if None not in keys and len(set(keys)) == len(keys):
            counts, prompt_seen = self._penalty_rows(vocab).rows_for(
                keys, [rows[i].prompt_token_ids for i in idx], [rows[i].output_token_ids for i in idx],
                [rows[i].inflight_src for i in idx], inflight_tokens)
        else:
            counts, prompt_seen = self._counts_from_lists(rows, idx, vocab, inflight_tokens)
        rep, freq, pres = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                     [p.presence_penalty for p in params]], torch.float32, dev)[:, :, None]
        rows_t = to_device(idx, torch.int64, dev)
        sub = logits.index_select(0, rows_t)
        sub = torch.where((counts > 0) | prompt_seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).float()
        return logits.index_copy(0, rows_t, sub)

    def _penalty_rows(self, vocab: int) -> PenaltyState:
        if self._penalties is None or self._penalties.vocab != vocab:
            self._penalties = PenaltyState(vocab, self.device)
        return self._penalties

    def _counts_from_lists(self, rows: list[SampleRow], idx: list[int], vocab: int,
                           inflight_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Output counts and prompt mask of rows ``idx`` from their whole token lists (rows without a key)."""
        dev = self.device
        outputs, late_rows, late_src = [], [], []
        for j, i in enumerate(idx):
            r = rows[i]
            if r.inflight_src is None:
                outputs.append(r.output_token_ids)
            else:
                outputs.append(r.output_token_ids[:-1])  # the placeholder
                late_rows.append(j)
                late_src.append(r.inflight_src)
        counts = token_counts(outputs, vocab, dev)  # [R', V]
        if late_rows:
            assert inflight_tokens is not None, "a row's token is in flight but the step has no in-flight tokens"
            index = to_device([late_rows, late_src], torch.int64, dev)
            counts.index_put_((index[0], inflight_tokens.index_select(0, index[1])),
                              torch.ones(len(late_rows), device=dev), accumulate=True)
        return counts, token_counts([rows[i].prompt_token_ids for i in idx], vocab, dev) > 0

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], rows: list[SampleRow] | None,
                flags: int) -> torch.Tensor:
        dev = self.device
        probs = sampling_probs(logits, params, flags, dev)
        if not flags & SAMPLE_SEEDED:
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        else:
            noise = torch.empty_like(probs)
            unseeded = [i for i, p in enumerate(params) if p.seed is None]
            if unseeded:
                noise.index_copy_(0, to_device(unseeded, torch.int64, dev), torch.empty(
                    len(unseeded), probs.shape[1], device=dev).exponential_(generator=self.generator))
            for i, r in enumerate(rows):
                if r.params.seed is not None:
                    gen = torch.Generator(device=dev).manual_seed(
                        row_seed(r.params.seed, r.index, r.num_output_tokens))
                    noise[i].exponential_(generator=gen)
        # Gumbel-max in exponential form: argmax p / E with E ~ Exp(1) samples from p
        return (probs / noise).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams], flags: int, device) -> torch.Tensor:
    """What random sampling draws from, per row: temperature, then top-k / top-p, then min-p (the rows below min-p
    set to zero, not renormalized: the draw does not need it)."""
    temps = to_device([max(p.temperature, 1e-5) for p in params], torch.float32, device)
    logits = logits / temps[:, None]
    if flags & SAMPLE_TOP_K_P:
        logits = _top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    probs = torch.softmax(logits, dim=-1)
    if flags & SAMPLE_MIN_P:
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = to_device([k if k > 0 else vocab for k in top_ks], torch.int64, logits.device).clamp(max=vocab)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
    p = to_device(top_ps, torch.float32, logits.device)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
