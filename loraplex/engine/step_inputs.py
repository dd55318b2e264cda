"""Host side of one step: token ids, positions, slot mapping, block tables, query offsets, sequence lengths.

Built once per step into persistent (pinned on CUDA) host buffers with numpy, so a step costs a few
list comprehensions over the scheduled requests plus array ops, never a Python loop per token:

- ``BlockTableRows`` keeps every running sequence's block table in a persistent ``[rows, max_blocks]``
  array and copies only what changed since the last step (a decode appends one block every
  ``block_size`` steps; a replaced list, after preemption or a prefix-cache admission, is rewritten;
  copy-on-write edits in place, so a step with block copies rewrites every scheduled row).
- ``StepInputBuilder.prepare`` gathers the step's rows and derives positions and slots with numpy.
  ``num_rows`` pads a pure-decode batch to a CUDA-graph bucket: padding rows get slot -1 (no KV write),
  sequence length 0 (no keys read) and token 0.

The buffers are reused every step; on CUDA a copy from them may still be in flight when the next step
starts (a step that samples nothing has no device->host sync), so ``prepare`` first waits for the event
recorded after the previous step's copies (``mark_copied``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SAMPLE_PROMPT_LOGPROBS
from loraplex.engine.scheduler_output import SchedulerOutput


class BlockTableRows:
    """Persistent block tables, one row per live sequence, synced incrementally from ``Request.block_ids``."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        self.table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._req: list[Request | None] = [None] * max_rows
        self._synced: list[list[int] | None] = [None] * max_rows  # the block_ids list object in the row
        self._len = [0] * max_rows  # blocks copied into the row
        self._free = list(range(max_rows - 1, -1, -1))
        self.num_row_writes = 0  # rows (re)written, for tests and the host-overhead bench

    def sync(self, reqs: list[Request], rewrite: bool = False) -> list[int]:
        """Rows of ``reqs`` (in order), each holding the request's current block ids."""
        rows = []
        row_of, synced, lens, table = self._row_of, self._synced, self._len, self.table
        for req in reqs:
            row = row_of.get(req.seq_id)
            if row is None:
                row = self._take_row(req)
            blocks = req.block_ids
            n = len(blocks)
            if synced[row] is not blocks or rewrite:
                table[row, :n] = blocks
                synced[row] = blocks
                lens[row] = n
                self.num_row_writes += 1
            elif n != lens[row]:
                start = lens[row]
                if n > start:
                    table[row, start:n] = blocks[start:]
                lens[row] = n
                self.num_row_writes += 1
            rows.append(row)
        return rows

    def _take_row(self, req: Request) -> int:
        if not self._free:
            self._release_stale()
        assert len(req.block_ids) <= self.max_blocks_per_seq
        row = self._free.pop()
        self._row_of[req.seq_id] = row
        self._req[row] = req
        self._synced[row] = None
        return row

    def _release_stale(self) -> None:
        """Free the rows of sequences no longer running (finished or preempted); they are re-synced
        in full if they come back."""
        for seq_id, row in list(self._row_of.items()):
            if self._req[row].status is not RequestStatus.RUNNING:
                del self._row_of[seq_id]
                self._req[row] = self._synced[row] = None
                self._free.append(row)
        assert self._free, "more live sequences than block-table rows"


@dataclass
class StepBatch:
    """One step's inputs on the host (views of the builder's buffers, valid until the next ``prepare``)."""

    num_seqs: int  # B: scheduled sequences
    num_tokens: int  # T: new tokens
    num_rows: int  # rows to run: T, or the CUDA-graph bucket of a padded pure-decode step
    graph_bucket: int | None  # the bucket (>= B) this pure-decode step is padded to, else None
    is_decode: bool  # every sequence has exactly one new token (T == B)
    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_rows] int64
    slot_mapping: torch.Tensor  # [num_rows] int64, -1 = padding (no KV write)
    block_tables: torch.Tensor  # [B, W] int32 (W = blocks of the longest sequence this step)
    query_start_loc: torch.Tensor  # [num_rows_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_rows_seqs] int32 (0 for padding rows)
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # leading sequences with one new token each (all of them in a pure-decode step)
    lora_ids: list[int] | None  # [B] adapter id per sequence (0 = base); None when the step has no adapter
    query_lens: np.ndarray  # [B] int64
    sample_counts: list[int]  # [B] tokens to sample from each sequence's last position
    last_token_rows: np.ndarray  # [B] int64: row of each sequence's last new token
    sampler_flags: int  # OR of the scheduled requests' ``SamplingParams.sampler_flags``
    lora_staging: torch.Tensor | None = None  # the builder's pinned [>= T] int64 buffer for token_lora_ids

    @property
    def any_prompt_logprobs(self) -> bool:
        return bool(self.sampler_flags & SAMPLE_PROMPT_LOGPROBS)

    def token_lora_ids(self) -> torch.Tensor:
        """[T] int64 adapter id of each new token (0 = base); in the builder's pinned buffer where it has one
        (an asynchronous copy to the device from pageable memory may wait for the stream)."""
        assert self.lora_ids is not None, "the step has no adapter"
        ids = np.repeat(np.asarray(self.lora_ids, dtype=np.int64), self.query_lens)
        if self.lora_staging is None:
            return torch.from_numpy(ids)
        out = self.lora_staging[:ids.size]
        out.numpy()[:] = ids
        return out


class StepInputBuilder:
    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # rows freed lazily (when the free list runs dry), so twice the live maximum keeps sweeps rare
        self.rows = BlockTableRows(2 * max_num_seqs + 1, self.max_blocks_per_seq)
        pin = self._pinned = self.device.type == "cuda" and torch.cuda.is_available()
        num_tokens = max(max_num_tokens, max_num_seqs)

        def buf(n, dtype):
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self._ids_t, self._pos_t, self._slots_t = (buf(num_tokens, torch.int64) for _ in range(3))
        self._qsl_t = buf(max_num_seqs + 1, torch.int32)
        self._lens_t = buf(max_num_seqs, torch.int32)
        self._lora_t = buf(num_tokens, torch.int64)  # StepBatch.token_lora_ids
        self._bt_t = buf(max_num_seqs * self.max_blocks_per_seq, torch.int32)
        self._ids, self._pos, self._slots = self._ids_t.numpy(), self._pos_t.numpy(), self._slots_t.numpy()
        self._qsl, self._lens, self._bt = self._qsl_t.numpy(), self._lens_t.numpy(), self._bt_t.numpy()
        self._arange = np.arange(max(num_tokens, max_num_seqs) + 1, dtype=np.int64)
        self._copied: torch.cuda.Event | None = None
        # host time blocked in prepare() until the previous step's input copies had run: with overlapped steps they
        # queue behind the step before, so this is waiting on the device too (EngineCore.device_wait_seconds)
        self.copy_wait_seconds = 0.0

    def mark_copied(self) -> None:
        """Record that every copy out of the buffers has been queued on the current stream."""
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def prepare(self, out: SchedulerOutput, bucket_for: Callable[[int], int | None] | None = None) -> StepBatch:
        """The step's inputs. For a pure-decode step, ``bucket_for(B)`` (a CUDA-graph bucket >= B, or None)
        pads the batch to that many rows."""
        if self._copied is not None:
            waited = time.perf_counter()
            self._copied.synchronize()  # the previous step's copies have left the buffers
            self.copy_wait_seconds += time.perf_counter() - waited
        sched = out.scheduled
        reqs = [s.request for s in sched]
        num_seqs = len(reqs)
        query_lens = np.array([s.num_new_tokens for s in sched], dtype=np.int64)
        computed_list = [r.num_computed_tokens for r in reqs]
        computed = np.asarray(computed_list, dtype=np.int64)
        rows = self.rows.sync(reqs, rewrite=bool(out.blocks_to_copy))
        num_tokens = int(query_lens.sum())
        is_decode = num_tokens == num_seqs
        num_rows = bucket_for(num_seqs) if is_decode and bucket_for is not None else None
        assert num_rows is None or num_rows >= num_seqs
        rows_out = num_rows or num_tokens
        seq_rows = num_rows or num_seqs  # sequences seen by attention (padding rows count as sequences)
        ar = self._arange
        bs = self.block_size

        if is_decode:
            self._ids[:num_tokens] = [r.token_ids[c] for r, c in zip(reqs, computed_list)]
            positions = computed
            seq_idx = ar[:num_seqs]
        else:
            self._ids[:num_tokens] = list(itertools.chain.from_iterable(
                r.token_ids[c:c + n] if s.draft_token_ids is None else [r.token_ids[c], *s.draft_token_ids]
                for s, r, c, n in zip(sched, reqs, computed_list, query_lens.tolist())))
            starts = np.cumsum(query_lens) - query_lens
            seq_idx = np.repeat(ar[:num_seqs], query_lens)
            positions = ar[:num_tokens] - np.repeat(starts - computed, query_lens)
        self._pos[:num_tokens] = positions

        seq_lens = computed + query_lens
        width = int(-(-seq_lens.max() // bs))
        block_tables = self._bt[:num_seqs * width].reshape(num_seqs, width)
        np.take(self.rows.table[:, :width], rows, axis=0, out=block_tables)
        self._slots[:num_tokens] = block_tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs

        self._lens[:num_seqs] = seq_lens
        self._qsl[0] = 0
        self._qsl[1:num_seqs + 1] = np.cumsum(query_lens)
        if seq_rows > num_seqs:  # padding rows: one token each, nothing stored or read
            pad = slice(num_tokens, rows_out)
            self._ids[pad] = 0
            self._pos[pad] = 0
            self._slots[pad] = -1
            self._lens[num_seqs:seq_rows] = 0
            self._qsl[num_seqs + 1:seq_rows + 1] = ar[num_seqs + 1:seq_rows + 1]
        last_rows = self._qsl[1:num_seqs + 1].astype(np.int64) - 1
        flags = 0
        for r in reqs:
            flags |= r.sampling_params.sampler_flags
        return StepBatch(
            num_seqs=num_seqs, num_tokens=num_tokens, num_rows=rows_out, graph_bucket=num_rows, is_decode=is_decode,
            input_ids=self._ids_t[:rows_out], positions=self._pos_t[:rows_out],
            slot_mapping=self._slots_t[:rows_out], block_tables=self._bt_t[:num_seqs * width].view(num_seqs, width),
            query_start_loc=self._qsl_t[:seq_rows + 1], seq_lens=self._lens_t[:seq_rows],
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            num_decodes=num_seqs if is_decode else int(np.argmax(query_lens != 1)),
            lora_ids=[r.lora_id for r in reqs] if out.lora_ids else None, query_lens=query_lens,
            sample_counts=[s.num_samples for s in sched], last_token_rows=last_rows,
            sampler_flags=flags, lora_staging=self._lora_t if self._pinned else None,
        )
