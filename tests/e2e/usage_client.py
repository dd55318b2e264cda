"""Load helpers for the usage e2e tests: a mixed request load whose clients record exactly what they
received, and a raw HTTP/1.1 SSE client that can abort mid-stream and still see every byte the server
sent before it noticed (it half-closes, then reads to EOF)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tests.conftest import adapter_dir

# token-id prompts: their prompt_tokens is their length, known without a tokenizer. Under one KV block
# (16) so aborted streams (whose usage the client never sees) have 0 cached tokens by construction.
SHORT_PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(5 + i % 8)] for i in range(24)]
LONG_PROMPT = [(11 * j) % 200 + 5 for j in range(40)]  # shared prefix: cache hits on completed requests


@dataclass
class Outcome:
    kind: str  # nonstream | stream | abort | invalid
    tenant: str
    model: str
    status: int = 0
    request_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False  # the client saw the whole response ([DONE] or the JSON body)

    @property
    def billed(self) -> bool:
        return self.status == 200


@dataclass
class Expected:
    totals: Counter = field(default_factory=Counter)  # (tenant, model) -> Counter of token sums

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> dict[tuple[str, str], Counter]:
        out: dict[tuple[str, str], Counter] = {}
        for o in outcomes:
            if not o.billed:
                continue
            c = out.setdefault((o.tenant, o.model), Counter())
            c["requests"] += 1
            c["prompt_tokens"] += o.prompt_tokens
            c["cached_prompt_tokens"] += o.cached_tokens
            c["completion_tokens"] += o.completion_tokens
        return out


def _token_count(event: dict) -> int:
    n = 0
    for ch in event.get("choices") or []:
        lp = ch.get("logprobs")
        if lp:
            n += len(lp.get("tokens") or [])
    return n


async def sse_completion(base_url: str, key: str, body: dict, abort_after_tokens: int | None = None,
                         timeout_s: float = 120.0) -> tuple[int, list[dict], bool]:
    """POST /v1/completions with stream=true over a raw socket. Returns (status, events, saw_done).
    With ``abort_after_tokens`` the client half-closes once it has read that many tokens and keeps
    reading until the server closes: every event the server wrote is in ``events``."""
    u = urlparse(base_url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    payload = json.dumps(body).encode()
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                  ).encode() + payload)
    await writer.drain()
    events: list[dict] = []
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                return status, [], False
            buf, tokens, aborted = b"", 0, False
            while True:
                size_line = await reader.readline()
                if not size_line.strip():
                    break  # EOF
                size = int(size_line.strip(), 16)
                if size == 0:
                    break
                try:
                    data = (await reader.readexactly(size + 2))[:-2]
                except asyncio.IncompleteReadError:
                    break  # a torn chunk at close: not delivered
                buf += data
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    text = raw.decode().removeprefix("data: ")
                    if text == "[DONE]":
                        done = True
                        continue
                    ev = json.loads(text)
                    events.append(ev)
                    tokens += _token_count(ev)
                if abort_after_tokens is not None and not aborted and tokens >= abort_after_tokens:
                    aborted = True
                    writer.write_eof()  # the server sees a disconnect; we still read what it already sent
            return status, events, done
    finally:
        writer.close()


async def run_one(client: httpx.AsyncClient, base_url: str, kind: str, tenant: str, key: str, model: str,
                  rng: random.Random, max_tokens: int) -> Outcome:
    o = Outcome(kind, tenant, model)
    headers = {"Authorization": f"Bearer {key}"}
    if kind == "invalid":
        r = await client.post("/v1/completions", headers=headers,
                              json={"model": model, "prompt": "x", "max_tokens": max_tokens, "temperature": 7})
        o.status = r.status_code
        return o
    if kind == "nonstream":
        if rng.random() < 0.5:
            r = await client.post("/v1/chat/completions", headers=headers, json={
                "model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": rng.randrange(1000),
                "messages": [{"role": "user", "content": f"Count to {rng.randrange(100)} quickly"}]})
        else:
            prompt = LONG_PROMPT if rng.random() < 0.5 else rng.choice(SHORT_PROMPTS)
            r = await client.post("/v1/completions", headers=headers, json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9})
        o.status = r.status_code
        if r.status_code == 200:
            body = r.json()
            o.request_id, u = body["id"], body["usage"]
            o.prompt_tokens, o.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
            o.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            o.finished = True
        return o
    prompt = rng.choice(SHORT_PROMPTS) if kind == "abort" else (LONG_PROMPT if rng.random() < 0.5 else
                                                                 rng.choice(SHORT_PROMPTS))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "logprobs": 1,
            "ignore_eos": True, "temperature": 0.8, "stream_options": {"include_usage": True}}
    abort_after = rng.randrange(1, max_tokens) if kind == "abort" else None
    o.status, events, o.finished = await sse_completion(base_url, key, body, abort_after)
    if o.status != 200:
        return o
    o.request_id = events[0]["id"] if events else None
    sent = sum(_token_count(e) for e in events)
    usage = next((e["usage"] for e in events if e.get("usage")), None)
    o.prompt_tokens = len(prompt)
    o.completion_tokens = sent
    if usage is not None:  # a stream that finished: its usage chunk must agree with what arrived
        assert usage["completion_tokens"] == sent and usage["prompt_tokens"] == len(prompt), (usage, sent)
        o.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    return o


def upload_adapter(server, key: str, manifest: dict, index: int, name: str) -> str:
    """Upload one of the tiny model's adapters as ``name``; returns the model id that calls it."""
    d = Path(adapter_dir(manifest, index))
    with server.client(key) as c:
        r = c.post("/v1/adapters", data={"name": name}, files={
            "config": ("adapter_config.json", (d / "adapter_config.json").read_bytes(), "application/json"),
            "weights": ("adapter_model.safetensors", (d / "adapter_model.safetensors").read_bytes(),
                        "application/octet-stream")})
        assert r.status_code == 201, r.text
        return r.json()["model"]


def export_rows(server, **params) -> list[dict]:
    with server.client() as c:
        r = c.get("/admin/usage/export", params={"format": "jsonl", **params})
        assert r.status_code == 200, r.text
        assert r.headers["x-usage-complete"] == "true"
        return [json.loads(line) for line in r.text.splitlines() if line]


def sums(rows: list[dict], key) -> dict:
    out: dict = {}
    for r in rows:
        c = out.setdefault(key(r), Counter())
        for f in ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
            c[f] += r[f]
    return out
