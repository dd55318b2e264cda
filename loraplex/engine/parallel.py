"""Tensor parallelism (Megatron-style) over ``torch.distributed``: NCCL between GPUs, gloo on the CPU.

Layout, for ``tensor_parallel_size`` = P and rank r (every rank holds 1/P of each layer's projections):
- q|k|v and gate|up are column-parallel: rank r keeps its heads' rows of q, k, v (``num_attention_heads`` /
  P query heads, ``num_key_value_heads`` / P KV heads) and its 1/P of gate's and up's rows; its KV cache holds
  only its KV heads, and attention runs on its heads alone. With fewer KV heads than ranks (MQA, or GQA with
  large P; P must then be a multiple of the KV heads) each KV head is replicated on P / KV-heads consecutive
  ranks, whose query heads are the ones that read it: rank r keeps KV head r // (P / KV-heads), its cache holds
  that one head (as vLLM and Megatron do it).
- o and down are row-parallel: rank r keeps the input columns that match its heads (o) or its share of the
  intermediate size (down), computes a partial sum, and one all-reduce per projection (two per layer) gives
  every rank the full output. Their biases live on rank 0 only (the others hold zeros), so the sum adds them once.
- Embeddings and norms are replicated. An untied LM head is vocabulary-parallel (rank r keeps 1/P of the vocabulary's
  rows; one all-gather puts the logits side by side); a tied one (the embedding table) is replicated. Every rank then
  holds the same logits and samples the same tokens (same seeds, and the collectives return identical bytes on every
  rank), so no token is broadcast.
- LoRA (as S-LoRA and vLLM shard it): a column-parallel slice keeps the whole ``lora_A`` and its rows of
  ``lora_B``; a row-parallel slice keeps its columns of ``lora_A`` and the whole ``lora_B``. The expand of a
  row-parallel slice adds ``(x_r A_r) B`` into rank r's partial output, and the projection's all-reduce sums
  them to ``(x A) B``: no collective beyond the base model's two.

Processes: rank 0 is the engine (scheduler, tokenizer, API); ranks 1..P-1 are worker processes it starts
(``multiprocessing`` spawn) that build the same ``ModelRunner`` on their shard and then execute, in the same
order, every step rank 0 executes. Each step rank 0 broadcasts the step over a gloo group before it launches
the step itself: workers mirror the requests (``StepSender`` / ``StepReceiver``: a request travels whole once,
then only what changed); adapter removals travel the same way. Start-up runs the same collective sequence on every rank (the KV cache size is
the minimum over ranks; warm-up passes and CUDA-graph captures run on every rank).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loraplex.adapters.modules import MODULES

log = logging.getLogger(__name__)

# the row-parallel projections: partial sums, one all-reduce each
ROW_PARALLEL_MODULES = ("o_proj", "down_proj")
WORKER_START_TIMEOUT_S = 600


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int
    kv_replicas: int = 1  # ranks sharing each KV head (kv_replicas())
    vocab_parallel: bool = False  # the LM head split by vocabulary rows (vocab_parallel())


_STATE: dict[str, Any] = {}  # "info": TPInfo, "cpu_group": the gloo group of control messages


def current() -> TPInfo | None:
    return _STATE.get("info")


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel projection's partial output over the ranks, in place (device group)."""
    dist.all_reduce(tensor)
    return tensor


def all_gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """[N, V/P] logits of each rank's vocabulary slice -> [N, V] on every rank (rank r's columns at r * V/P)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def vocab_parallel(hf_config: dict, size: int) -> bool:
    """Whether the LM head is split by vocabulary rows over ``size`` ranks: an untied head whose vocabulary divides
    evenly (a tied head is the embedding table, which every rank needs whole)."""
    return size > 1 and not hf_config.get("tie_word_embeddings", False) and hf_config["vocab_size"] % size == 0


def _kv_heads(hf_config: dict) -> int:
    return hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]


def with_layout(info: TPInfo, hf_config: dict) -> TPInfo:
    """``info`` with the whole model's layout decisions (KV-head replicas, vocabulary-parallel head), made once here
    for the model, its checkpoint shards and its adapters."""
    return dataclasses.replace(info, kv_replicas=kv_replicas(hf_config, info.size),
                               vocab_parallel=vocab_parallel(hf_config, info.size))


def check_shardable(hf_config: dict, size: int) -> None:
    """Raise ValueError unless the model's heads and intermediate size split evenly over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    heads = hf_config["num_attention_heads"]
    kv_heads = _kv_heads(hf_config)
    inter = hf_config["intermediate_size"]
    for name, value in (("num_attention_heads", heads), ("intermediate_size", inter)):
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {name} ({value})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's num_key_value_heads ({kv_heads}) or "
                         "be a multiple of it (each KV head then replicated)")


def kv_replicas(hf_config: dict, size: int) -> int:
    """Ranks holding each KV head: 1, or size / KV heads when there are fewer KV heads than ranks."""
    return max(1, size // _kv_heads(hf_config))


def local_hf_config(hf_config: dict, size: int) -> dict:
    """The config of one rank's shard: 1/size of the heads, KV heads and intermediate size; head_dim kept."""
    check_shardable(hf_config, size)
    if size == 1:
        return hf_config
    heads = hf_config["num_attention_heads"]
    local = dict(hf_config)
    local["head_dim"] = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    local["num_attention_heads"] = heads // size
    local["num_key_value_heads"] = max(1, _kv_heads(hf_config) // size)
    local["intermediate_size"] = hf_config["intermediate_size"] // size
    return local


def _part(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * n, n)


KV_MODULES = ("k_proj", "v_proj")


def _column_part(module: str, tensor: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """A column-parallel module's output rows for this rank: 1/P of them, or for k and v with ``kv_replicas`` R > 1
    the whole KV head this rank shares with R - 1 others (its rows: 1/(P/R) of them)."""
    if module in KV_MODULES and info.kv_replicas > 1:
        return _part(tensor, 0, info.rank // info.kv_replicas, info.size // info.kv_replicas)
    return _part(tensor, 0, info.rank, info.size)


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """One rank's part of a Hugging Face checkpoint tensor (replicated tensors are returned whole)."""
    parts = name.split(".")  # model.layers.<i>.<self_attn|mlp>.<module>.<weight|bias>
    module = parts[-2] if len(parts) >= 3 else ""
    if name == "lm_head.weight" and info.vocab_parallel:
        return _part(tensor, 0, info.rank, info.size)  # vocabulary-parallel head
    if info.size == 1 or ".layers." not in name or module not in MODULES:
        return tensor  # embeddings, norms, a tied LM head
    if module not in ROW_PARALLEL_MODULES:
        return _column_part(module, tensor, info)  # column-parallel: output rows (weight and bias)
    if parts[-1] == "bias":
        return tensor if info.rank == 0 else torch.zeros_like(tensor)  # added once by the all-reduce
    return _part(tensor, 1, info.rank, info.size)  # row-parallel: input columns


def shard_lora_pair(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, info: TPInfo):
    """One rank's (lora_A [r, in], lora_B [out, r]) of a PEFT module (see the module doc)."""
    if info.size == 1:
        return lora_a, lora_b
    if module in ROW_PARALLEL_MODULES:
        return _part(lora_a, 1, info.rank, info.size), lora_b
    return lora_a, _column_part(module, lora_b, info)


# ---- processes ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, device: torch.device, port: int) -> TPInfo:
    """Join the process group (NCCL on CUDA, gloo on the CPU) and make the gloo group of control messages."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from datetime import timedelta

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=WORKER_START_TIMEOUT_S),
                            **({"device_id": device} if device.type == "cuda" else {}))
    _STATE["cpu_group"] = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _STATE["info"] = info = TPInfo(rank, size)
    return info


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: ``cuda:r`` (offset by the driver's index when it names one); the CPU for every rank."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    base = dev.index or 0
    if base + rank >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism over {rank + 1}+ ranks from {device} needs GPU {base + rank}; this "
                         f"process sees {torch.cuda.device_count()}")
    return f"cuda:{base + rank}"


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks (every rank calls it at the same point)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE["cpu_group"])
    return int(t.item())


def _trailing_placeholders(tokens: list[int]) -> int:
    n = 0
    while n < len(tokens) and tokens[-1 - n] < 0:  # PLACEHOLDER_TOKEN: a token still being sampled on the device
        n += 1
    return n


class StepSender:
    """Rank 0's side of the step messages. A worker keeps a mirror of each request (``StepReceiver``): a request
    travels whole once, the first time it is scheduled (without its detokenizer and output records); after that
    a step carries, per scheduled request, its computed length, the tokens from the first one not yet sent as
    final (a trailing placeholder is sent again until its real token is known), its block ids when they changed
    (the new ones when the list grew, else the whole list) and the step's sizes; and the status of every mirrored request whose status changed (finished ones are then forgotten)."""

    def __init__(self) -> None:
        self._sent: dict[int, list] = {}  # seq_id -> [request, tokens sent as final, status last sent]

    def message(self, out) -> tuple:
        new, updates, steps = [], [], []
        sent = self._sent
        for sched in out.scheduled:
            req = sched.request
            state = sent.get(req.seq_id)
            tokens = req.token_ids
            if state is None:
                view = copy.copy(req)
                view.detokenizer = None
                view.logprobs = []
                view.token_ids = list(tokens)
                view.block_ids = list(req.block_ids)
                view.prompt_logprobs = [None] * len(req.prompt_logprobs)
                new.append(view)
                state = sent[req.seq_id] = [req, 0, req.status, view.block_ids]
                start, tail, blocks = len(tokens), [], None
            else:
                start = state[1]
                tail = tokens[start:]
                blocks, saved = None, state[3]
                current = req.block_ids
                if current != saved:  # appended (new blocks only), else trimmed or replaced (the whole list)
                    n = len(saved)
                    blocks = (n, current[n:]) if len(current) > n and current[:n] == saved else (0, list(current))
                    state[3] = list(current)
            state[1] = len(tokens) - _trailing_placeholders(tokens)
            state[2] = req.status
            num_prompt_logprobs = len(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else -1
            updates.append((req.seq_id, req.num_computed_tokens, start, tail, blocks, num_prompt_logprobs))
            steps.append((req.seq_id, sched.num_new_tokens, sched.num_samples, sched.draft_token_ids))
        changed = []
        for seq_id, state in list(sent.items()):
            status = state[0].status
            if status is not state[2]:
                changed.append((seq_id, status))
                state[2] = status
                if status.finished:
                    del sent[seq_id]
        return (new, updates, steps, changed, out.blocks_to_copy, out.lora_ids, out.has_prompt_chunks,
                out.num_draft_tokens)


class StepReceiver:
    """A worker's mirror of the requests rank 0 schedules, rebuilt into a ``SchedulerOutput`` each step."""

    def __init__(self) -> None:
        self.requests: dict = {}  # seq_id -> the mirrored Request

    def apply(self, message: tuple):
        from loraplex.engine.request import RequestStatus
        from loraplex.engine.scheduler_output import ScheduledRequest, SchedulerOutput

        new, updates, steps, changed, blocks_to_copy, lora_ids, has_prompt_chunks, num_draft_tokens = message
        reqs = self.requests
        for view in new:
            reqs[view.seq_id] = view
        for seq_id, status in changed:
            req = reqs.get(seq_id)
            if req is not None:
                req.status = status  # the block-table rows of a request no longer running are released
                if status.finished:
                    del reqs[seq_id]
        for seq_id, computed, start, tail, blocks, num_prompt_logprobs in updates:
            req = reqs[seq_id]
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = computed
            if tail or start != len(req.token_ids):
                del req.token_ids[start:]
                req.token_ids.extend(tail)
            if blocks is not None:
                start_block, part = blocks
                mine = req.block_ids
                if start_block:
                    mine.extend(part)  # appended (as rank 0's list grew): the row copies only the new ones
                elif len(part) < len(mine) and mine[:len(part)] == part:
                    del mine[len(part):]  # trimmed (blocks of rejected drafts)
                else:
                    req.block_ids = part  # another list: the row is written in full
            if num_prompt_logprobs >= 0 and num_prompt_logprobs != len(req.prompt_logprobs):
                req.prompt_logprobs = [None] * num_prompt_logprobs
        return SchedulerOutput(
            scheduled=[ScheduledRequest(reqs[seq_id], n, samples, drafts) for seq_id, n, samples, drafts in steps],
            blocks_to_copy=blocks_to_copy, lora_ids=lora_ids, has_prompt_chunks=has_prompt_chunks,
            num_draft_tokens=num_draft_tokens)


class Driver:
    """Rank 0's side: starts the workers, broadcasts each step and control message, stops them."""

    def __init__(self, config) -> None:
        import multiprocessing as mp

        self.size = config.tensor_parallel_size
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(config, rank, port), daemon=True,
                                  name=f"loraplex-tp{rank}") for rank in range(1, self.size)]
        for p in self.procs:
            p.start()
        self.sender = StepSender()
        # a worker that dies leaves rank 0 blocked in its next collective: the watchdog notices and calls this
        # (default: SIGTERM to this process, so a server drains and exits, and its orchestrator restarts it)
        self.on_worker_death = _terminate_self
        self.closed = False
        try:
            init_group(0, self.size, torch.device(rank_device(config.device, 0)), port)
        except BaseException:
            self.abort()
            raise
        threading.Thread(target=self._watch, name="loraplex-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.closed:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self.closed:
                    log.critical("tensor parallel: worker rank %d exited (code %s); the engine cannot go on",
                                 rank, p.exitcode)
                    self.on_worker_death()
                    return
            time.sleep(0.5)

    def _send(self, message) -> None:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=_STATE["cpu_group"])

    def start(self, async_scheduling: bool) -> None:
        """After rank 0's start-up: whether steps overlap (the workers keep the same step in flight)."""
        self._send(("start", async_scheduling))

    def step(self, out, has_prev: bool) -> None:
        self._send(("step", self.sender.message(out), has_prev))

    def remove_adapter(self, adapter_id: int) -> None:
        self._send(("remove_adapter", adapter_id))

    def add_adapter(self, lora_request) -> None:
        """``add_lora`` on rank 0: every rank reads its shard now."""
        self._send(("add_adapter", lora_request))

    def keep_adapter(self, lora_request) -> None:
        """``pin_lora`` on rank 0: every rank reads it (if it has not) and holds it in a slot."""
        self._send(("keep_adapter", lora_request))

    def abort(self) -> None:
        """Rank 0 failed to start: the workers may wait in a collective that will never come; end them."""
        self.closed = True
        self._end_workers(join_timeout=0)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._send(("stop",))
        except Exception:  # noqa: BLE001 - a worker that died already: join what is left
            log.exception("tensor parallel: the stop message did not reach every worker")
        self._end_workers(join_timeout=30)

    def _end_workers(self, join_timeout: float) -> None:
        """Wait up to ``join_timeout`` s for each worker to exit, terminate what is left, leave the group."""
        for p in self.procs:
            p.join(timeout=join_timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
        _STATE.clear()


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def worker_main(config, rank: int, port: int) -> None:
    """A worker rank: the same runner on its shard, then every step rank 0 broadcasts, until "stop"."""
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "WARNING"))
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    init_group(rank, config.tensor_parallel_size, torch.device(config.device), port)
    from loraplex.engine.model_runner import ModelRunner

    runner = ModelRunner(config)
    config.resolve(runner.max_len_limit())
    runner.start_up()
    async_scheduling = bool(_receive()[1])  # the driver's decision, after its own start-up
    prev = None
    mirror = StepReceiver()
    while True:
        message = _receive()
        kind = message[0]
        if kind == "stop":
            break
        if kind == "remove_adapter":
            if runner.lora_manager is not None:
                runner.lora_manager.remove_adapter(message[1])
                runner.lora_manager.take_dropped()  # (rank 0's prefix cache is the one that forgets)
            continue
        if kind in ("add_adapter", "keep_adapter"):
            if runner.lora_manager is not None:
                _register_adapter(runner.lora_manager, message[1], keep=kind == "keep_adapter")
            continue
        _, step, has_prev = message
        out = mirror.apply(step)
        if runner.lora_manager is not None:
            runner.register_step_adapters(out)
        pending = runner.launch(out, prev if has_prev else None)
        if prev is not None:
            prev.result()
        prev = None
        if async_scheduling and pending.is_async:
            prev = pending
        else:
            pending.result()
    if dist.is_initialized():
        dist.destroy_process_group()


def _register_adapter(manager, lora_request, keep: bool) -> None:
    """Rank 0's ``add_lora`` / ``pin_lora`` on this rank. Rank 0 read the same files a moment ago: a failure here
    (they changed or went away since) is logged, and the rank tries again at the first step that uses the adapter."""
    try:
        manager.validate_and_prefetch(lora_request)
        if keep:
            manager.keep_resident(lora_request.lora_int_id)
    except Exception:  # noqa: BLE001 - the rank goes on: its steps are rank 0's to decide
        log.exception("tensor parallel: adapter %d could not be registered on this rank", lora_request.lora_int_id)


def _receive():
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_STATE["cpu_group"])
    return box[0]

