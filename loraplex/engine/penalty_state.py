"""Per-sequence token counts for the repetition / frequency / presence penalties, kept on the device across steps.

Every step, a penalized row needs how often each vocabulary token occurs in its output so far, and whether it occurs
in its prompt. Rebuilding both from the token lists each step costs host time in proportion to every penalized
sequence's whole context: one concatenation and one scatter of R x context ids, 6.4 ms per step at 256 sequences of
~1,100 tokens on the 2-core CPU machine (docs/benchmarks/host_overhead_cpu.md). Here each sequence holds a row of two
persistent buffers instead. The row is filled once from its prompt and output, then extended each step by the tokens
appended since the step before (usually one).

Rows are keyed by (seq_id, sample index); seq_ids are unique in the process. A key's output only ever grows: each
step sees the list of the step before plus new tokens. If it is ever shorter than what was counted, the row is
rebuilt. An overlapped step's newest token is still a placeholder on the host; its value is read from the device
(``inflight_tokens``) and counted then. The host later writes that same token into the list, and it is not counted
again.

When the rows run out, those of keys absent from the step are freed (finished, preempted, or not sampling this
step; a key that comes back is rebuilt). If that is not enough, the buffers grow. They hold the peak number of
penalized sequences seen: R x vocab x 5 bytes (float32 counts and a bool mask), 164 MB at 256 rows of a 128k
vocabulary. The per-step rebuild this replaces allocated two float32 R x vocab tensors every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Key = tuple[int, int]


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts, with one scatter. A row may be an int64 numpy array
    (the step sampler keeps each request's prompt as one, so a long prompt is not converted again)."""
    arrays = [t if isinstance(t, np.ndarray) else np.asarray(t, dtype=np.int64) for t in token_lists]
    lens = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays, dtype=np.int64) if lens.sum() else np.zeros(0, dtype=np.int64)
    index = np.repeat(np.arange(len(arrays), dtype=np.int64) * vocab, lens) + flat
    counts = torch.zeros(len(arrays) * vocab, device=device)
    index_t = torch.from_numpy(index).to(device, non_blocking=True)
    counts.index_add_(0, index_t, torch.ones(index.size, device=device))
    return counts.view(len(arrays), vocab)


def _indices(values, device) -> torch.Tensor:
    """A host list (or list of lists) of ints as an int64 device tensor, without a stream sync."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device, non_blocking=True)


class PenaltyState:
    """The persistent rows (module doc). ``rows_for`` returns a step's [R, vocab] output counts and prompt mask."""

    def __init__(self, vocab: int, device, min_rows: int = 16):
        self.vocab = vocab
        self.device = torch.device(device)
        self.min_rows = min_rows
        self.counts = torch.zeros(0, vocab, device=self.device)  # float32 occurrences in the output
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)
        self._row: dict[Key, int] = {}
        self._counted: dict[Key, int] = {}  # output tokens already in the row (a counted placeholder included)
        self._free: list[int] = []
        self.rebuilt = 0  # rows filled from whole token lists (new keys, returning keys, shrunk lists)

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def __len__(self) -> int:
        return len(self._row)

    def rows_for(self, keys: Sequence[Key], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                 inflight_src: Sequence[int | None], inflight_tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts [R, vocab] float32 and prompt mask [R, vocab] bool of the step's rows, in order. ``outputs[j]``
        ends with a placeholder when ``inflight_src[j]`` is not None; its token is ``inflight_tokens[src]``.
        Keys must be distinct."""
        assert len(set(keys)) == len(keys), "one row per key and step"
        fresh, delta_rows, delta_tokens, late_rows, late_src = [], [], [], [], []
        for j, key in enumerate(keys):
            out = outputs[j]
            src = inflight_src[j]
            known = len(out) - (src is not None)
            counted = self._counted.get(key)
            if counted is None or counted > len(out):
                fresh.append(j)
                continue
            row = self._row[key]
            if counted < known:
                new = out[counted:known]
                delta_rows.extend([row] * len(new))
                delta_tokens.extend(new)
            if src is not None and counted <= known:
                late_rows.append(row)
                late_src.append(src)
            self._counted[key] = len(out)
        if fresh:
            self._make_rows([keys[j] for j in fresh], keys)
            rows = [self._row[keys[j]] for j in fresh]
            rows_t = _indices(rows, self.device)
            known_out = [outputs[j][:len(outputs[j]) - (inflight_src[j] is not None)] for j in fresh]
            self.counts.index_copy_(0, rows_t, token_counts(known_out, self.vocab, self.device))
            self.prompt_seen.index_copy_(0, rows_t, token_counts([prompts[j] for j in fresh], self.vocab,
                                                                 self.device) > 0)
            for j, row in zip(fresh, rows):
                self._counted[keys[j]] = len(outputs[j])
                if inflight_src[j] is not None:
                    late_rows.append(row)
                    late_src.append(inflight_src[j])
            self.rebuilt += len(fresh)
        if delta_rows:
            index = _indices([delta_rows, delta_tokens], self.device)
            self.counts.index_put_((index[0], index[1]), torch.ones(len(delta_rows), device=self.device),
                                   accumulate=True)
        if late_rows:
            assert inflight_tokens is not None, "a row's token is in flight but the step has no in-flight tokens"
            index = _indices([late_rows, late_src], self.device)
            self.counts.index_put_((index[0], inflight_tokens.index_select(0, index[1]).long()),
                                   torch.ones(len(late_rows), device=self.device), accumulate=True)
        step_rows = _indices([self._row[k] for k in keys], self.device)
        return self.counts.index_select(0, step_rows), self.prompt_seen.index_select(0, step_rows)

    def _make_rows(self, new_keys: list[Key], step_keys: Sequence[Key]) -> None:
        """Give each new key a row (a returning or shrunk key gives its old one back first): free rows, then the
        rows of keys not in this step, then more rows."""
        for key in new_keys:
            self._release(key)
        if len(self._free) < len(new_keys):
            in_step = set(step_keys)
            for key in [k for k in self._row if k not in in_step]:
                self._release(key)
        missing = len(new_keys) - len(self._free)
        if missing > 0:
            self._grow(max(self.min_rows, 2 * self.capacity, self.capacity + missing))
        for key in new_keys:
            self._row[key] = self._free.pop()

    def _release(self, key: Key) -> None:
        row = self._row.pop(key, None)
        self._counted.pop(key, None)
        if row is not None:
            self._free.append(row)

    def _grow(self, rows: int) -> None:
        old = self.capacity
        counts = torch.zeros(rows, self.vocab, device=self.device)
        seen = torch.zeros(rows, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self._free.extend(range(rows - 1, old - 1, -1))
