"""The rolling window behind ``loraplex batch``: keep up to ``max_in_flight`` lines in the engine, add the next
line as soon as one finishes, and write results in input order through a bounded reorder buffer.

Lines are numbered by ``seq`` (their place among the output records). A line that finishes before an older one
waits in the buffer; the window stops admitting lines once ``max_unwritten`` of them (running plus waiting in
the buffer) sit behind the oldest unwritten line, so one very long line bounds memory instead of growing it.

No exception of one line ends the run: a line the format cannot read, the engine refuses, or that fails while it is
read, admitted, run or written out gets an error record of its own (an unexpected exception is logged with its
traceback), and the other lines run. Only what fails the run itself (an engine step, writing OUTPUT) propagates.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.engine.outputs import RequestOutput, apply_delta
from loraplex.engine.protocol import TokenDelta

log = logging.getLogger(__name__)


@dataclass
class Line:
    """One non-blank input line: what to run, or why it cannot run (``error``)."""

    seq: int  # 0-based place among the records this run writes
    line_no: int  # 1-based physical line of the input
    id: Any  # echoed to the output as it came (JSON type kept)
    prompt: str | dict | None = None
    params: Any = None
    lora: Any = None
    error: Any = None  # why the line cannot run: a message, or its format's own error object (openai_format)
    request: Any = None  # what the line's output format needs beside its outputs (openai_format.Request)


class LineFormat(Protocol):
    """An input and output format (own_format, openai_format): how a line is read, and the record of a line that ran
    or could not."""

    def parse(self, seq: int, line_no: int, raw: bytes) -> Line:
        """What the line asks to run, or why it cannot run (``error``)."""

    def line_id(self, line_no: int, raw: bytes) -> Any:
        """The line's id as its record echoes it, for a line :meth:`parse` failed on."""

    def observe(self, line: Line, delta: TokenDelta) -> None:
        """One engine delta of the line's request, as it comes (before it is folded into the line's output)."""

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        """``failed``: a sample ended with finish_reason "error" (its ``error`` says why)."""

    def refused(self, line: Line) -> dict:
        """A line that did not run: ``line.error`` says why."""

    def engine_refused(self, line: Line, exc: ValueError) -> Any:
        """The ``error`` of a line the engine refused to add (a prompt over the context, n over max_num_seqs)."""

    def crashed(self, exc: Exception) -> Any:
        """The ``error`` of a line that failed on an unexpected exception (a defect, logged with its traceback)."""


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
    def __init__(self, llm, write: Callable[[bytes], None], line_format: LineFormat, max_in_flight: int,
                 max_unwritten: int):
        assert 1 <= max_in_flight <= max_unwritten, (max_in_flight, max_unwritten)
        self.llm = llm
        self.format = line_format
        self.write = write
        self.max_in_flight = max_in_flight
        self.max_unwritten = max_unwritten
        self.stats = WindowStats()
        self._in_flight: dict[str, tuple[Line, RequestOutput]] = {}  # request id -> line, its output so far
        self._done: dict[int, tuple[Line, bytes, bool, int, int]] = {}  # seq -> record, failed, tokens
        self._next_write = 0  # seq of the oldest unwritten line
        self._next_seq = 0  # seq the next admitted line must have

    def run(self, rows: Iterator[tuple[int, bytes]], stop: Callable[[], bool], tick: Callable[[], None]) -> bool:
        """Run every line (``rows``: each non-blank input line's number and bytes); False when ``stop()`` turned
        true first (in-flight lines are then aborted and only the records before the oldest unfinished line are
        written)."""
        engine = self.llm.engine
        exhausted = False
        while True:
            while (not exhausted and not stop() and len(self._in_flight) < self.max_in_flight
                   and self._next_seq - self._next_write < self.max_unwritten):
                row = next(rows, None)
                if row is None:
                    exhausted = True
                    break
                self._admit(self._read(*row))
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
                if entry is not None:
                    self._take(delta, *entry)
            self.stats.num_in_flight = len(self._in_flight)
            self._write_ready()
            tick()
        while engine.has_unfinished_requests():  # an overlapped step left in flight after the last finish
            engine.step()
        assert not self._done and self._next_write == self._next_seq
        return True

    def _read(self, line_no: int, raw: bytes) -> Line:
        seq = self._next_seq
        try:
            return self.format.parse(seq, line_no, raw)
        except Exception as exc:  # noqa: BLE001 (a defect reading one line fails that line, not the run)
            log.exception("batch: input line %d could not be read; it fails, the other lines run", line_no)
            return Line(seq, line_no, self.format.line_id(line_no, raw), error=self.format.crashed(exc))

    def _admit(self, line: Line) -> None:
        assert line.seq == self._next_seq, (line.seq, self._next_seq)
        self._next_seq += 1
        if line.error is None:
            # each line is queued on its own, so a prompt the engine refuses (too long, ids outside the
            # vocabulary) is that line's error and every other line still runs
            try:
                request_id, out = self.llm._add_request(line.prompt, line.params, line.lora, 0)
            except ValueError as exc:
                line.error = self.format.engine_refused(line, exc)
            except Exception as exc:  # noqa: BLE001 (nothing was queued: the line fails, the run goes on)
                log.exception("batch: input line %d could not be added to the engine; it fails, the other lines "
                              "run", line.line_no)
                line.error = self.format.crashed(exc)
            else:
                self._in_flight[request_id] = (line, out)
                self.stats.max_in_flight_seen = max(self.stats.max_in_flight_seen, len(self._in_flight))
        if line.error is not None:
            self._record(line, lambda: self.format.refused(line), True)
        self.stats.max_unwritten_seen = max(self.stats.max_unwritten_seen, self._next_seq - self._next_write)

    def _take(self, delta: TokenDelta, line: Line, out: RequestOutput) -> None:
        """One engine delta of ``line``'s request; its record once the request has finished."""
        try:
            self.format.observe(line, delta)
            apply_delta(out, delta)
        except Exception as exc:  # noqa: BLE001
            log.exception("batch: input line %d failed while it ran; it fails, the other lines run", line.line_no)
            del self._in_flight[delta.request_id]
            self.llm.engine.abort_request(delta.request_id)  # its last deltas find it no longer in flight
            line.error = self.format.crashed(exc)
            self._record(line, lambda: self.format.refused(line), True)
            return
        if out.finished:
            del self._in_flight[delta.request_id]
            failed = any(c.finish_reason == "error" for c in out.outputs)
            self._record(line, lambda: self.format.finished(line, out, failed), failed, len(out.prompt_token_ids),
                         sum(len(c.token_ids) for c in out.outputs))

    def _record(self, line: Line, record: Callable[[], dict], failed: bool, num_prompt: int = 0,
                num_output: int = 0) -> None:
        """Queue ``line``'s record for writing; a record that cannot be built is the line's failure."""
        try:
            data = _dumps(record())
        except Exception as exc:  # noqa: BLE001
            log.exception("batch: the output line of input line %d could not be built; it fails, the other lines "
                          "run", line.line_no)
            line.error = self.format.crashed(exc)
            data, failed = _dumps(self.format.refused(line)), True
        self._done[line.seq] = (line, data, failed, num_prompt, num_output)

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


def _dumps(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode("utf-8")
