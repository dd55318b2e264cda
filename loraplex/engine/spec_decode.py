"""Speculative decoding with n-gram (prompt lookup) drafts, verified by the target model in one step.

A decoding sequence whose last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred before
in its own context (prompt and output) gets the tokens that followed that earlier occurrence as a draft of up to
``num_speculative_tokens`` tokens. The step then computes the sequence's newest token and the draft together
(``1 + k`` query tokens, as a prompt chunk over the cached prefix) and samples ``1 + k`` positions at once:

- greedy: draft token i is accepted while it equals the argmax at position i; the first position whose argmax
  differs (or the position after the last draft token) gives the one new token of the model's own. The tokens are
  the non-speculative engine's, up to the logits' rounding differing between a one-token and a multi-token step.
- random (temperature, top-k, top-p, min-p): the draft is a point mass, so draft token ``d`` at a position whose
  processed distribution is ``p`` is accepted with probability ``p(d)``; at the first rejection the token is drawn
  from ``p`` with ``d`` removed (renormalized), and after a fully accepted draft from the next position's ``p``.
  Every emitted token has exactly the distribution of plain sampling (the rejection-sampling rule of Leviathan et
  al. / Chen et al. with a deterministic draft).

So a step emits 1 to ``k + 1`` tokens per speculating sequence. Drafted positions that were rejected leave KV
behind the sequence's computed length; the next step overwrites it (prefix caching registers only blocks full of
computed tokens, so nothing rejected is ever shared).

Only sequences whose sampling needs no per-token history run drafts: greedy or random with temperature, top-k,
top-p and min-p, one sample (no ``n > 1`` fork pending). Penalties, seeds, logprobs, logit bias, bad words and
min_tokens decode one token per step as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loraplex.engine.sampling_params import SAMPLE_MIN_P, SAMPLE_RANDOM, SAMPLE_TOP_K_P, SamplingParams

if TYPE_CHECKING:  # the scheduler imports the proposer, and the scheduler never imports torch
    import torch

# sampler features under which a draft can be verified in one step (no per-token history in the sampler)
SPEC_FLAGS = SAMPLE_RANDOM | SAMPLE_TOP_K_P | SAMPLE_MIN_P
SPEC_METHODS = ("ngram",)


def check_lookup_sizes(min_n: int, max_n: int) -> None:
    """The n-gram sizes prompt lookup tries: 1 <= prompt_lookup_min <= prompt_lookup_max."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got {min_n} and {max_n}")


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request with these sampling parameters may run drafts."""
    return not params.sampler_flags & ~SPEC_FLAGS and params.n == 1


class NgramProposer:
    """Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the context's last n tokens,
    n from ``max_n`` down to ``min_n`` (the longest match wins); searched in the last ``window`` tokens.

    Host cost per proposal: one vectorized compare of the window against the newest token, then a few compares per
    candidate. Each sequence's context is kept as a numpy array that grows by the step's new tokens (``key``: the
    sequence's id; ``forget`` it when the sequence ends), so no step turns a long context into an array again."""

    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4, window: int = 4096):
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        check_lookup_sizes(min_n, max_n)
        self.num_tokens, self.min_n, self.max_n, self.window = num_tokens, min_n, max_n, window
        self._contexts: dict[int, tuple[np.ndarray, int]] = {}  # key -> (buffer, tokens in it)

    def forget(self, key: int) -> None:
        self._contexts.pop(key, None)

    def _context(self, token_ids: list[int], key: int | None) -> np.ndarray:
        n = len(token_ids)
        if key is None:
            return np.asarray(token_ids[-self.window:], dtype=np.int64)
        buf, have = self._contexts.get(key, (None, 0))
        if buf is None or have > n or (have and buf[have - 1] != token_ids[have - 1]):
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0  # new, or the tokens changed: rebuild
        if n > buf.size:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = token_ids[have:]
        self._contexts[key] = (buf, n)
        return buf[max(0, n - self.window):n]

    def propose(self, token_ids: list[int], max_tokens: int | None = None, key: int | None = None) -> list[int]:
        """Up to ``min(num_tokens, max_tokens)`` draft tokens for a context ending in ``token_ids[-1]``; [] when
        no n-gram of the context's tail occurred earlier."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ctx = self._context(token_ids, key)
        size = ctx.size
        cand = np.flatnonzero(ctx[:size - 1] == ctx[size - 1])  # earlier positions of the newest token
        if not cand.size:
            return []
        # length of the match ending at each candidate (up to max_n), extended one token back at a time
        length = np.ones(cand.size, dtype=np.int64)
        alive = np.ones(cand.size, dtype=bool)
        for back in range(1, min(self.max_n, size - 1)):
            prev = cand - back
            ok = alive & (prev >= 0)
            ok[ok] = ctx[prev[ok]] == ctx[size - 1 - back]
            length += ok
            alive = ok
            if not alive.any():
                break
        best = int(length.max())
        if best < self.min_n:
            return []
        start = int(cand[length == best][-1]) + 1  # the latest occurrence of the longest match: its continuation
        return ctx[start:start + k].tolist()


@dataclass
class Verified:
    """Per speculating sequence (in the order given to ``verify``): the tokens it emits this step (the accepted
    draft tokens, then one of the model's own) and the raw model logprob of each."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


def _processed_probs(logits: torch.Tensor, params: list[SamplingParams], flags: int, device) -> torch.Tensor:
    """The distribution plain sampling draws from, per row (``sampler.sampling_probs``), normalized (after min-p)."""
    from loraplex.engine.sampler import sampling_probs

    probs = sampling_probs(logits, params, flags, device)
    if flags & SAMPLE_MIN_P:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generator: torch.Generator) -> Verified:
    """Accept or reject each sequence's draft. ``logits`` [R, V] float32: sequence j owns ``len(drafts[j]) + 1``
    consecutive rows (the positions of its newest token and of each draft token), in order. One device->host copy.
    """
    import torch

    device = logits.device
    counts = [len(d) + 1 for d in drafts]
    row_params = [p for p, c in zip(params, counts) for _ in range(c)]
    rows = logits.shape[0]
    assert rows == sum(counts), f"{rows} logits rows for drafts needing {sum(counts)}"
    # the draft token each row is asked about (the last row of a sequence has none: -1)
    asked = np.full(rows, -1, dtype=np.int64)
    ends = np.cumsum(counts)
    for d, end in zip(drafts, ends.tolist()):
        asked[end - len(d) - 1:end - 1] = d
    asked_t = torch.from_numpy(asked).to(device, non_blocking=True)
    has_draft = asked_t >= 0
    safe = asked_t.clamp(min=0)
    raw = torch.log_softmax(logits, dim=-1)
    greedy_tok = logits.argmax(dim=-1)
    flags = 0
    for p in params:
        flags |= p.sampler_flags
    if flags & SAMPLE_RANDOM:
        probs = _processed_probs(logits, row_params, flags, device)
        p_draft = probs.gather(1, safe[:, None]).squeeze(1)
        u = torch.rand(rows, device=device, generator=generator)
        accept = has_draft & (u < p_draft)
        # a rejected row draws from p without its draft token; a last row from p itself
        residual = probs.scatter(1, safe[:, None], torch.where(has_draft, 0.0, p_draft)[:, None])
        noise = torch.empty_like(residual).exponential_(generator=generator)
        random_tok = (residual / noise).argmax(dim=-1)
        greedy_rows = torch.tensor([p.greedy for p in row_params], dtype=torch.bool).to(device, non_blocking=True)
        accept = torch.where(greedy_rows, has_draft & (greedy_tok == asked_t), accept)
        own = torch.where(greedy_rows, greedy_tok, random_tok)
    else:
        accept = has_draft & (greedy_tok == asked_t)
        own = greedy_tok
    packed = torch.stack((accept.double(), own.double(), raw.gather(1, own[:, None]).squeeze(1).double(),
                          raw.gather(1, safe[:, None]).squeeze(1).double())).cpu().numpy()
    acc, own_ids, own_lps, draft_lps = packed[0] > 0, packed[1].astype(np.int64), packed[2], packed[3]
    token_ids, logprobs = [], []
    start = 0
    for d, c in zip(drafts, counts):
        a = 0
        while a < len(d) and acc[start + a]:
            a += 1
        token_ids.append(list(d[:a]) + [int(own_ids[start + a])])
        logprobs.append(draft_lps[start:start + a].tolist() + [float(own_lps[start + a])])
        start += c
    return Verified(token_ids, logprobs)
