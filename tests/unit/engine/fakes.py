"""A model-free runner for scheduler tests: each sampled token is a fixed function of the sequence so far,
so outputs do not depend on batching, chunking or preemption."""

from __future__ import annotations

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(token_ids: list[int], index: int) -> int:
    return (sum(token_ids[-3:]) * 31 + len(token_ids) * 7 + index * 13) % VOCAB


def fake_run(out: SchedulerOutput, block_size: int) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for s in out.scheduled:
        req = s.request
        # the runner may only touch slots the block table covers
        assert len(req.block_ids) * block_size >= req.num_computed_tokens + s.num_new_tokens
        if s.num_samples:
            result.sampled_token_ids[req.seq_id] = [next_token(req.token_ids, req.index + i) for i in range(s.num_samples)]
    return result


def make_scheduler(num_blocks=64, block_size=16, max_num_seqs=256, max_num_batched_tokens=512,
                   max_model_len=4096, max_loras=8, prefix=True, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_loras=max_loras,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, **kw)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=prefix))


def make_request(rid, prompt, max_tokens=8, **kw) -> Request:
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id=str(rid), prompt_token_ids=list(prompt), sampling_params=params, **kw)


def run_to_completion(sched: Scheduler, max_steps=100_000, on_step=None) -> dict[tuple[str, int], list[int]]:
    outputs: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        if on_step:
            on_step(out)
        for req in sched.update_from_output(out, fake_run(out, sched.block_manager.block_size)):
            if req.is_finished:
                outputs[(req.request_id, req.index)] = req.output_token_ids
    raise AssertionError("did not finish")


def expected_output(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids, index))
    return ids[len(prompt):]
