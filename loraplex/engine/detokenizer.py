"""Incremental detokenization and stop strings (pure Python; the tokenizer is passed in).

Decodes a small window of recent tokens each step (vLLM's prefix/read offsets), so the cost per token is
constant and multi-byte characters split across tokens appear only once complete. ``append_batch`` does
one step for many requests with a single Rust ``decode_batch`` call of a fast tokenizer (the same text
as ``decode`` per window, without a Python-level call per window).
"""

from __future__ import annotations

import copy

_PROMPT_CONTEXT = 6  # prompt tokens kept as left context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        # streamed text lags by the longest stop string minus one, so a stop string is never half-sent
        self.holdback = 0 if include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1
        self._new_text_start = 0  # where the last append's text begins (stop strings are searched from there)

    def fork(self) -> IncrementalDetokenizer:
        child = copy.copy(self)
        child.token_ids = list(self.token_ids)
        return child

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> str:
        """Add one token; returns the newly completed text (may be empty)."""
        prefix_window, new_window = self._push(token_id)
        return self._apply(self._decode(prefix_window), self._decode(new_window))

    def _push(self, token_id: int) -> tuple[list[int], list[int]]:
        """Add the token; the two windows whose text the step needs (before and with the new tokens)."""
        self.token_ids.append(token_id)
        self._new_text_start = len(self.output_text)
        return self.token_ids[self.prefix_offset:self.read_offset], self.token_ids[self.prefix_offset:]

    def _apply(self, prefix_text: str, new_text: str) -> str:
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.output_text += delta
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        # keep the window small: drop tokens left of prefix_offset
        if self.prefix_offset > _PROMPT_CONTEXT:
            drop = self.prefix_offset
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return delta

    def check_stop_strings(self, stop: list[str], include_stop_str_in_output: bool) -> str | None:
        """Search for a stop string ending in the last token's text; on a match truncate the text and
        return it. (Called after every token once min_tokens is reached, as vLLM does.)"""
        start = max(0, self._new_text_start - max(len(s) for s in stop) + 1)
        best = None
        for s in stop:
            pos = self.output_text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.output_text = self.output_text[:pos + len(s)] if include_stop_str_in_output else self.output_text[:pos]
        return s

    def drop_last_text(self) -> None:
        """Forget the text the last ``append`` added (the caller has not sent any of it)."""
        self.output_text = self.output_text[:self._new_text_start]

    def streamable_text_len(self, finished: bool) -> int:
        """How much of ``output_text`` may be sent now."""
        if finished:
            return len(self.output_text)
        return max(0, len(self.output_text) - self.holdback)


def append_batch(detokenizers: list[IncrementalDetokenizer], token_ids: list[int]) -> None:
    """``d.append(t)`` for each pair, decoding every window of one tokenizer and skip setting in one call."""
    groups: dict[tuple[int, bool], list[int]] = {}
    windows: list[list[int]] = []
    for i, (d, t) in enumerate(zip(detokenizers, token_ids)):
        windows.extend(d._push(t))
        groups.setdefault((id(d.tokenizer), d.skip_special_tokens), []).append(i)
    texts: list[str] = [""] * len(windows)
    for (_, skip), members in groups.items():
        tokenizer = detokenizers[members[0]].tokenizer
        group_windows = [w for i in members for w in windows[2 * i:2 * i + 2]]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # equals decode(clean_up_tokenization_spaces=False) of a fast tokenizer
            decoded = backend.decode_batch(group_windows, skip_special_tokens=skip)
        else:
            decoded = [detokenizers[members[0]]._decode(w) for w in group_windows]
        for k, i in enumerate(members):
            texts[2 * i], texts[2 * i + 1] = decoded[2 * k], decoded[2 * k + 1]
    for i, d in enumerate(detokenizers):
        d._apply(texts[2 * i], texts[2 * i + 1])
