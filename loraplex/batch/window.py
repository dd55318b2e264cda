"""The rolling window behind ``loraplex batch``: keep up to ``max_in_flight`` lines in the engine, add the next
line as soon as one finishes, and write results in input order through a bounded reorder buffer.

Lines are numbered by ``seq`` (their place among the output records). A line that finishes before an older one
waits in the buffer; the window stops admitting lines once ``max_unwritten`` of them (running plus waiting in
the buffer) sit behind the oldest unwritten line, so one very long line bounds memory instead of growing it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.engine.outputs import CompletionOutput, Logprob, RequestOutput, apply_delta

log = logging.getLogger(__name__)
_OUTPUT_FIELDS = ("index", "text", "token_ids", "finish_reason", "stop_reason", "error")


@dataclass
class Line:
    """One non-blank input line: what to run, or why it cannot run (``error``)."""

    seq: int  # 0-based place among the records this run writes
    line_no: int  # 1-based physical line of the input
    id: Any  # echoed to the output as it came (JSON type kept)
    prompt: str | dict | None = None
    params: Any = None
    lora: Any = None
    error: str | None = None
    error_param: str | None = None  # the request field ``error`` is about, where one is named (OpenAI's "param")
    error_code: str | None = None  # what kind of error (OpenAI's error "code"); loraplex's own records omit it
    request: Any = None  # what the line's output format needs beside its outputs (openai_format.Request)


@dataclass
class WindowStats:
    num_ok: int = 0
    num_failed: int = 0
    num_prompt_tokens: int = 0  # of lines written
    num_output_tokens: int = 0
    num_written: int = 0
    last_line_no: int = 0  # input line of the newest record written
    num_in_flight: int = 0
    max_in_flight_seen: int = 0
    max_unwritten_seen: int = 0
    num_dropped: int = 0  # finished or running when stopped, not written (they run again on --resume)


class RollingWindow:
    def __init__(self, llm, write: Callable[[bytes], None], max_in_flight: int, max_unwritten: int,
                 refusal_text: Callable[[str], str] = str, records: Records | None = None):
        """``refusal_text``: the engine's refusal of a line as that line's error says it (the batch command names
        its flags where the engine names its config fields). ``records``: the output format (default loraplex's)."""
        assert 1 <= max_in_flight <= max_unwritten, (max_in_flight, max_unwritten)
        self.llm = llm
        self.records = records or LoraplexRecords()
        self.refusal_text = refusal_text
        self.write = write
        self.max_in_flight = max_in_flight
        self.max_unwritten = max_unwritten
        self.stats = WindowStats()
        self._in_flight: dict[str, tuple[Line, RequestOutput]] = {}  # request id -> line, its output so far
        self._done: dict[int, tuple[Line, bytes, bool, int, int]] = {}  # seq -> record, failed, tokens
        self._next_write = 0  # seq of the oldest unwritten line
        self._next_seq = 0  # seq the next admitted line must have

    def run(self, lines: Iterator[Line], stop: Callable[[], bool], tick: Callable[[], None]) -> bool:
        """Run every line; False when ``stop()`` turned true first (in-flight lines are then aborted and
        only the records before the oldest unfinished line are written)."""
        engine = self.llm.engine
        exhausted = False
        while True:
            while (not exhausted and not stop() and len(self._in_flight) < self.max_in_flight
                   and self._next_seq - self._next_write < self.max_unwritten):
                line = next(lines, None)
                if line is None:
                    exhausted = True
                    break
                self._admit(line)
            self._write_ready()
            if stop():
                self._stop()
                return False
            if not self._in_flight:
                if exhausted:
                    break
                continue  # only lines that failed at once were admitted: admit more
            for delta in engine.step():
                entry = self._in_flight.get(delta.request_id)
                if entry is None:
                    continue
                apply_delta(entry[1], delta)
                if entry[1].finished:
                    del self._in_flight[delta.request_id]
                    self._finish(*entry)
            self.stats.num_in_flight = len(self._in_flight)
            self._write_ready()
            tick()
        while engine.has_unfinished_requests():  # an overlapped step left in flight after the last finish
            engine.step()
        assert not self._done and self._next_write == self._next_seq
        return True

    def _admit(self, line: Line) -> None:
        assert line.seq == self._next_seq, (line.seq, self._next_seq)
        self._next_seq += 1
        if line.error is None:
            # each line is queued on its own, so a prompt the engine refuses (too long, ids outside the
            # vocabulary) is that line's error and every other line still runs
            try:
                request_id, out = self.llm._add_request(line.prompt, line.params, line.lora, 0)
            except ValueError as exc:
                line.error = self.refusal_text(str(exc))
                line.error_param = getattr(exc, "param", None)
            else:
                self._in_flight[request_id] = (line, out)
                self.stats.max_in_flight_seen = max(self.stats.max_in_flight_seen, len(self._in_flight))
        if line.error is not None:
            self._done[line.seq] = (line, _dumps(self.records.refused(line)), True, 0, 0)
        self.stats.max_unwritten_seen = max(self.stats.max_unwritten_seen, self._next_seq - self._next_write)

    def _finish(self, line: Line, out: RequestOutput) -> None:
        failed = any(c.finish_reason == "error" for c in out.outputs)
        num_output = sum(len(c.token_ids) for c in out.outputs)
        self._done[line.seq] = (line, _dumps(self.records.finished(line, out, failed)), failed,
                                len(out.prompt_token_ids), num_output)

    def _write_ready(self) -> None:
        stats = self.stats
        while self._next_write in self._done:
            line, data, failed, num_prompt, num_output = self._done.pop(self._next_write)
            self.write(data)
            self._next_write += 1
            stats.num_written += 1
            stats.num_failed += failed
            stats.num_ok += not failed
            stats.num_prompt_tokens += num_prompt
            stats.num_output_tokens += num_output
            stats.last_line_no = line.line_no

    def _stop(self) -> None:
        self.stats.num_dropped = len(self._in_flight) + len(self._done)
        if self._in_flight:
            self.llm._abandon(list(self._in_flight))  # aborts them and steps until the engine is empty
        self._in_flight.clear()
        self._done.clear()
        self.stats.num_in_flight = 0


class Records(Protocol):
    """An output format: the record of a line that ran, and of one that could not."""

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        """``failed``: a sample ended with finish_reason "error" (its ``error`` says why)."""

    def refused(self, line: Line) -> dict:
        """A line that did not run: ``line.error`` says why."""


class LoraplexRecords:
    """loraplex's own output lines: ``{"id", "outputs", "num_prompt_tokens", "num_cached_tokens"}`` (plus logprobs
    where the line's params ask for them), or ``{"id", "error"}``."""

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        record = {"id": line.id, "num_prompt_tokens": len(out.prompt_token_ids),
                  "num_cached_tokens": out.num_cached_tokens,
                  "outputs": [_output_record(c, line.params.logprobs is not None) for c in out.outputs]}
        if line.params.prompt_logprobs is not None:
            record["prompt_logprobs"] = [_logprob_entry(e) for e in out.prompt_logprobs or []]
        return record

    def refused(self, line: Line) -> dict:
        return {"id": line.id, "error": line.error}


def _output_record(comp: CompletionOutput, with_logprobs: bool) -> dict:
    record = {k: getattr(comp, k) for k in _OUTPUT_FIELDS}
    if with_logprobs:  # only when the line asked for them: they are most of a line's size
        record["logprobs"] = [_logprob_entry(e) for e in comp.logprobs or []]
        record["cumulative_logprob"] = comp.cumulative_logprob
    return record


def _logprob_entry(entry: dict[int, Logprob] | None) -> dict[str, dict] | None:
    """One position's logprobs as vLLM's API writes them: token id (a JSON key, so a string) -> its logprob,
    rank and text."""
    if entry is None:
        return None
    return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()}


def _dumps(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode("utf-8")
