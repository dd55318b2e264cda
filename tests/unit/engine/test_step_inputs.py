"""The vectorized step-input builder against the straightforward per-request construction it replaced,
on random workloads driven through the real scheduler (chunked prefill, decodes, forks with copy-on-write,
preemption, prefix-cache admissions, aborts), with and without CUDA-graph bucket padding."""

from __future__ import annotations

import random

import numpy as np
import torch

from loraplex.engine.cuda_graphs import graph_buckets
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.step_inputs import StepInputBuilder
from tests.unit.engine.fakes import fake_run, make_request, make_scheduler

ADAPTERS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)]  # ids only: no weights are read


def reference_inputs(out, block_size: int) -> dict:
    """The model runner's original construction: one Python pass per request, then torch."""
    token_ids, num_computed, num_new, tables, lora_ids = [], [], [], [], []
    for s in out.scheduled:
        req = s.request
        start = req.num_computed_tokens
        token_ids.extend(req.token_ids[start:start + s.num_new_tokens])
        num_computed.append(start)
        num_new.append(s.num_new_tokens)
        tables.append(req.block_ids)
        lora_ids.append(req.lora_id)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = torch.tensor(num_new)
    ctx = torch.tensor(num_computed)
    query_start_loc = torch.zeros(len(num_new) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    seq_idx = torch.repeat_interleave(torch.arange(len(num_new)), q_lens)
    positions = torch.arange(len(token_ids)) - (query_start_loc[:-1].long() - ctx)[seq_idx]
    slot_mapping = block_tables[seq_idx, positions // block_size].long() * block_size + positions % block_size
    return dict(input_ids=torch.tensor(token_ids), positions=positions, slot_mapping=slot_mapping,
                block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=(ctx + q_lens).int(),
                token_lora_ids=torch.repeat_interleave(torch.tensor(lora_ids), q_lens))


def check_batch(batch, ref: dict, block_size: int) -> None:
    t, b = batch.num_tokens, batch.num_seqs
    assert t == ref["input_ids"].numel() and b == ref["seq_lens"].numel()
    for name in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(batch, name)[:t], ref[name]), name
    assert torch.equal(batch.seq_lens[:b], ref["seq_lens"])
    assert torch.equal(batch.query_start_loc[:b + 1], ref["query_start_loc"])
    if batch.lora_ids is None:
        assert not ref["token_lora_ids"].any()
    else:
        assert torch.equal(batch.token_lora_ids(), ref["token_lora_ids"])
    for row, n in enumerate(ref["seq_lens"].tolist()):  # the blocks a sequence's keys live in
        used = -(-n // block_size)
        assert torch.equal(batch.block_tables[row, :used], ref["block_tables"][row, :used]), f"row {row}"
    assert batch.max_seq_len == int(ref["seq_lens"].max())
    assert batch.max_query_len == int((ref["query_start_loc"][1:] - ref["query_start_loc"][:-1]).max())
    q_lens = (ref["query_start_loc"][1:] - ref["query_start_loc"][:-1]).tolist()
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert batch.num_decodes == leading  # the rows the decode kernel may take in a mixed step
    assert leading == q_lens.count(1)  # the scheduler lists every one-token sequence first
    last = ref["query_start_loc"][1:].long() - 1
    assert np.array_equal(batch.last_token_rows, last.numpy())
    if batch.graph_bucket is not None:  # padding rows: no KV write, no keys, one token each
        rows = batch.num_rows
        assert batch.is_decode and rows == batch.graph_bucket >= b
        assert (batch.slot_mapping[b:rows] == -1).all() and (batch.seq_lens[b:rows] == 0).all()
        assert (batch.input_ids[b:rows] == 0).all()
        assert torch.equal(batch.query_start_loc, torch.arange(rows + 1, dtype=torch.int32))


def _random_workload(seed: int, bucket_for) -> tuple[int, int, int]:
    rng = random.Random(seed)
    block_size = 4
    sched = make_scheduler(num_blocks=120, block_size=block_size, max_num_seqs=24, max_num_batched_tokens=40,
                           max_model_len=256)
    builder = StepInputBuilder(24, 40, 256, block_size, torch.device("cpu"))
    shared = [rng.randrange(1, 500) for _ in range(12)]  # common prefix: prefix-cache admissions
    num_padded = num_decode = num_lora = num_mixed = 0
    for step in range(400):
        if rng.random() < 0.35 and sched.num_unfinished < 40:
            prompt = (shared if rng.random() < 0.4 else []) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(n=n, max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True)
            lora = rng.choice([None, None, *ADAPTERS])
            sched.add_request(make_request(f"r{step}", prompt, params=params, priority=rng.choice([0, 0, 1]),
                                           lora_request=lora))
        if rng.random() < 0.03 and sched.running:
            sched.abort_request(rng.choice(sched.running).request_id)
        out = sched.schedule()
        if out.is_empty:
            continue
        batch = builder.prepare(out, bucket_for)
        assert out.has_prompt_chunks == (not batch.is_decode)
        check_batch(batch, reference_inputs(out, block_size), block_size)
        num_padded += batch.num_rows > batch.num_seqs
        num_lora += batch.lora_ids is not None
        num_decode += batch.is_decode
        num_mixed += not batch.is_decode and batch.num_decodes > 0
        sched.update_from_output(out, fake_run(out, block_size))
    assert num_lora > 0 and num_mixed > 0  # some mixed steps led with decodes
    return num_padded, num_decode, sched.num_preemptions + sched.block_manager.num_cow_copies


def test_builder_matches_reference_on_random_workloads():
    for seed in range(3):
        _, num_decode, num_events = _random_workload(seed, None)
        assert num_decode > 0 and num_events > 0  # decode steps, preemptions and copy-on-write were covered


def test_builder_pads_pure_decode_steps_to_graph_buckets():
    buckets = graph_buckets(24)

    def bucket_for(num_seqs):
        return next((b for b in buckets if b >= num_seqs), None)

    num_padded, num_decode, _ = _random_workload(7, bucket_for)
    assert num_padded > 0 and num_decode > num_padded // 2


def test_block_table_rows_copy_only_what_changed():
    """A decode step rewrites a row only when its sequence gained a block (every block_size steps)."""
    block_size = 4
    sched = make_scheduler(num_blocks=400, block_size=block_size, max_num_seqs=32, max_num_batched_tokens=512)
    builder = StepInputBuilder(32, 512, 4096, block_size, torch.device("cpu"))
    for i in range(32):
        sched.add_request(make_request(i, [1 + i] * 9, params=SamplingParams(max_tokens=64, temperature=0.0,
                                                                             ignore_eos=True)))
    out = sched.schedule()  # all prompts in one step
    builder.prepare(out)
    sched.update_from_output(out, fake_run(out, block_size))
    writes = builder.rows.num_row_writes
    assert writes == 32
    for _ in range(8):  # tokens 10..17 of each sequence: blocks start at tokens 12 and 16
        out = sched.schedule()
        check_batch(builder.prepare(out), reference_inputs(out, block_size), block_size)
        sched.update_from_output(out, fake_run(out, block_size))
    assert builder.rows.num_row_writes - writes == 2 * 32


def test_graph_buckets():
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_buckets(1) == [1]
    assert graph_buckets(400)[-4:] == [256, 320, 384, 400]
