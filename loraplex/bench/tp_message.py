"""Host cost of the tensor-parallel step messages (engine/parallel.py): rank 0 building and pickling a decode step's
message, and a worker unpickling it and updating its mirrored requests, for a batch of sequences of a given
context (random tokens, full block tables), against the first design that pickled every scheduled request whole.

    python -m loraplex.bench.tp_message [--seqs 256] [--context 1024] [--steps 20] [--out ...]

No model and no process group: the same ``StepSender`` / ``StepReceiver`` the engine uses, timed on this host.
"""

from __future__ import annotations

import argparse
import copy
import logging
import pickle
import random
import statistics
import sys
import time

from loraplex.bench.report import markdown_head

log = logging.getLogger("loraplex.bench.tp_message")


def _requests(num: int, context: int, block_size: int):
    from loraplex.engine.request import Request, RequestStatus
    from loraplex.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    reqs = []
    for i in range(num):
        r = Request(f"r{i}", [rng.randrange(128_000) for _ in range(context)], SamplingParams(max_tokens=4096))
        r.block_ids = list(range(i * 1000, i * 1000 + -(-context // block_size)))
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, context
        reqs.append(r)
    return reqs


def _whole_requests(out):
    """The first design: every scheduled request pickled whole each step (without detokenizer and outputs)."""
    slim = copy.copy(out)
    slim.scheduled = [copy.copy(s) for s in out.scheduled]
    for s in slim.scheduled:
        view = s.request = copy.copy(s.request)
        view.detokenizer, view.logprobs = None, []
    return slim


def run(num: int, context: int, steps: int, block_size: int = 16) -> dict:
    from loraplex.engine.parallel import StepReceiver, StepSender
    from loraplex.engine.scheduler_output import ScheduledRequest, SchedulerOutput

    reqs = _requests(num, context, block_size)
    out = SchedulerOutput(scheduled=[ScheduledRequest(r, 1, 1) for r in reqs])
    sender, mirror = StepSender(), StepReceiver()
    mirror.apply(pickle.loads(pickle.dumps(sender.message(out))))  # the first step sends every request whole
    send, recv, size, whole_send, whole_recv = [], [], [], [], []
    for step in range(steps):
        for r in reqs:  # one decode step: a token each, a new block every block_size steps
            r.token_ids.append(step)
            r.num_computed_tokens += 1
            if r.num_computed_tokens % block_size == 0:
                r.block_ids.append(r.block_ids[-1] + 1)
        t0 = time.perf_counter()
        blob = pickle.dumps(sender.message(out))
        t1 = time.perf_counter()
        mirror.apply(pickle.loads(blob))
        t2 = time.perf_counter()
        whole = pickle.dumps(_whole_requests(out))
        t3 = time.perf_counter()
        pickle.loads(whole)
        t4 = time.perf_counter()
        send.append(t1 - t0)
        recv.append(t2 - t1)
        size.append(len(blob))
        whole_send.append(t3 - t2)
        whole_recv.append(t4 - t3)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"seqs": num, "context": context, "steps": steps, "send_ms": ms(send), "receive_ms": ms(recv),
            "message_kB": statistics.median(size) / 1e3, "whole_send_ms": ms(whole_send),
            "whole_receive_ms": ms(whole_recv), "whole_kB": len(whole) / 1e3}


def markdown(payload: dict) -> str:
    lines = [*markdown_head("Tensor-parallel step messages: host cost per decode step", payload["command"]),
             f"Environment: {payload['environment']}. Medians over the steps.", "",
             "| sequences | context | mirrored: send ms | mirrored: receive ms | mirrored kB | whole requests: send ms | "
             "whole requests: receive ms | whole kB |", "|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['seqs']} | {r['context']} | {r['send_ms']:.2f} | {r['receive_ms']:.2f} | "
                     f"{r['message_kB']:.1f} | {r['whole_send_ms']:.2f} | {r['whole_receive_ms']:.2f} | "
                     f"{r['whole_kB']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from loraplex.bench.report import environment, module_command, write_json_and_markdown

    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.tp_message", description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="64,256")
    parser.add_argument("--context", default="1024,4096")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="docs/benchmarks/tp-step-message-cpu.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    rows = [run(n, c, args.steps) for n in map(int, args.seqs.split(",")) for c in map(int, args.context.split(","))]
    payload = {"command": module_command("loraplex.bench.tp_message", argv),
               "environment": environment(torch.device("cpu")), "rows": rows}
    write_json_and_markdown(args.out, payload, markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
