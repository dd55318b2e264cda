"""CUDA graphs for the steps that are not pure decode (prefill, chunked prefill, decodes mixed with prompts),
captured piecewise around attention.

Without a graph such a step launches every kernel from Python: ~400 launches for a base Llama-3-8B step, ~650
with adapters, whose host time (21-48 ms on the H200's host for 248 decodes + a 384-token prompt) exceeded the
GPU's (17-21 ms). Attention cannot sit inside a graph captured per token count: its grids and its decode /
varlen split depend on how the step's tokens fall into sequences. Everything else works row by row, so it can.

A step of T tokens runs the pieces of the smallest token bucket >= T. With L layers there are L + 1 pieces:

    piece 0       embedding, RoPE cos/sin, layer 0 up to attention (norm, q|k|v + LoRA, RoPE, K/V store)
    piece i       layer i-1 after attention (o + LoRA, norm, MLP + LoRA), layer i up to attention
    piece L       layer L-1 after attention, the final norm

and between pieces the attention of layer i runs eagerly on the step's real T rows and its real metadata,
reading q from and writing its output into static buffers that the pieces read and write. Each piece copies what
the next one needs (q, residual, cos/sin, final hidden) into those static buffers, so no graph output has to stay
alive between steps and every piece shares one memory pool. Rows T..bucket are padding: token 0 at position 0,
KV slot -1 (the store skips them), LoRA slot -1; attention never reads them and their values are never sampled.

With adapters, piece 0 also builds the step's LoRA kernel metadata from the static per-token slots (so it is
rebuilt by every replay, before any piece reads it), planned like the decode graphs for ``min(bucket, max_loras)``
distinct adapters: correct for any mix. Buckets below ``lora_ops.PREFILL_TILES_MIN_TOKENS`` (3,584) get the LoRA
kernels' decode tiles whatever the step holds, measured faster than the prefill tiles there even for one long prompt
(docs/benchmarks/H200-2026-12-05-run24.md).

``capture=False`` runs the same pieces without graphs (the CPU tests check the padding and the split against
the eager forward).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.cuda_graphs import BucketedGraphs

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts with graphs: steps of 16 to 128, then of an eighth of the bucket (a multiple of 16), so a
    step of T > 128 tokens is padded by less than T / 7; the last bucket is ``max_tokens`` itself."""
    buckets, b = [], 16
    while b < max_tokens:
        buckets.append(b)
        b += max(16, b // 8 // 16 * 16)
    buckets.append(max_tokens)
    return buckets


class PiecewiseGraphRunner(BucketedGraphs):
    def __init__(self, model, kv_caches: list, backend: AttentionBackend, max_tokens: int, device: torch.device,
                 capture: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = torch.device(device)
        self.capture_graphs = capture
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        n, dev, cfg = self.max_tokens, self.device, model.config
        dtype = model.embed_tokens.dtype
        q_size = cfg.num_heads * cfg.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(n, q_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.cos = torch.zeros(n, cfg.head_dim, dtype=dtype, device=dev)
        self.sin = torch.zeros(n, cfg.head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        pin = dev.type == "cuda" and torch.cuda.is_available()
        self._slots_host = torch.full((n,), -1, dtype=torch.int32, pin_memory=pin)
        # (bucket, with adapters) -> the pieces' graphs (None without capture), and the LoRA step captured with them
        # (kept alive: its metadata tensors are the ones the graphs read and write)
        self._graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph | None]] = {}
        self._lora_steps: dict[tuple[int, bool], object] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None  # the captures' side stream
        self.num_steps = 0
        self.used_keys: set[tuple[int, bool]] = set()

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    @property
    def num_graphs(self) -> int:
        return sum(1 for graphs in self._graphs.values() for g in graphs if g is not None)

    # ---- one step ------------------------------------------------------------------------------------
    def run(self, batch, attn: AttentionMetadata, lora_manager=None, slot_of: dict[int, int] | None = None,
            fixup=None, inputs_queued=None) -> torch.Tensor:
        """Final hidden states [T, H] of the step's T = ``batch.num_tokens`` rows (a view of a static buffer,
        valid until the next step). ``attn``: the step's own attention metadata (real sizes); ``slot_of`` maps
        each adapter of the step to its GPU slot (already assigned), None for a base-only step."""
        num_tokens = batch.num_tokens
        bucket = self.bucket_for(num_tokens)
        assert bucket is not None, f"{num_tokens} tokens: more than the largest bucket {self.max_tokens}"
        key = (bucket, bool(slot_of))
        if key not in self._graphs:
            self.capture(key, lora_manager)
        self._load_inputs(batch, bucket, slot_of if key[1] else None)
        if fixup is not None:
            fixup(self.input_ids)
        if inputs_queued is not None:
            inputs_queued()
        graphs, lora = self._graphs[key], None
        q, out = self.q[:num_tokens], self.attn_out[:num_tokens].view(num_tokens, *self.q.shape[1:])
        for i in range(self.num_pieces):
            if graphs[i] is None:
                lora = self._piece(i, key, lora_manager, lora)
            else:
                graphs[i].replay()
            if i < len(self.model.layers):
                self.backend.attention(q, self.kv_caches[i], attn, self.model.layers[i].scale, out=out)
        self.num_steps += 1
        self.used_keys.add(key)
        return self.hidden[:num_tokens]

    def _load_inputs(self, batch, bucket: int, slot_of: dict[int, int] | None) -> None:
        t = batch.num_tokens
        nb = self.device.type == "cuda"
        self.input_ids[:t].copy_(batch.input_ids[:t], non_blocking=nb)
        self.positions[:t].copy_(batch.positions[:t], non_blocking=nb)
        self.slot_mapping[:t].copy_(batch.slot_mapping[:t], non_blocking=nb)
        if bucket > t:  # padding rows: no KV write (the rows of an earlier, larger step may still hold slots)
            self.slot_mapping[t:bucket].fill_(-1)
        if slot_of is not None:
            host = self._slots_host.numpy()
            seq_slots = np.fromiter((slot_of.get(a, -1) for a in batch.lora_ids), dtype=np.int32,
                                    count=len(batch.lora_ids))
            host[:t] = np.repeat(seq_slots, batch.query_lens)
            host[t:bucket] = -1
            self.token_slots[:bucket].copy_(self._slots_host[:bucket], non_blocking=nb)

    def _piece(self, i: int, key: tuple[int, bool], lora_manager, lora):
        """Run piece ``i`` of ``key`` (module doc) on the static buffers with the step's ``lora`` (None for a
        base step); returns the LoRA step the later pieces read (piece 0 builds it)."""
        bucket, with_lora = key
        model, ops = self.model, self.model.ops
        layers = model.layers
        # only the slot mapping is read inside the pieces (the K/V store); attention runs between them
        store = AttentionMetadata(backend=self.backend, slot_mapping=self.slot_mapping[:bucket],
                                  block_tables=self.slot_mapping[:0], query_start_loc=self.slot_mapping[:0],
                                  seq_lens=self.slot_mapping[:0], max_query_len=0, max_seq_len=0)
        cos, sin = self.cos[:bucket], self.sin[:bucket]
        if i == 0:
            lora = None
            if with_lora:
                # built here so that every replay of piece 0 rebuilds the metadata from the static slots
                lora = lora_manager.make_step(self.token_slots[:bucket], min(bucket, lora_manager.max_loras))
            hidden, c, s = model.embed(self.input_ids[:bucket], self.positions[:bucket])
            cos.copy_(c)
            sin.copy_(s)
            residual = None
        else:
            layer = layers[i - 1]
            hidden, residual = layer.post_attention(self.attn_out[:bucket], self.residual[:bucket], lora, ops)
        if i < len(layers):
            q, residual = layers[i].pre_attention(hidden, residual, cos, sin, self.kv_caches[i], store, lora, ops)
            self.q[:bucket].copy_(q)
            self.residual[:bucket].copy_(residual)
        else:
            self.hidden[:bucket].copy_(model.final_norm(hidden, residual))
        return lora

    # ---- capture -------------------------------------------------------------------------------------
    def _capture(self, key: tuple[int, bool], lora_manager) -> None:
        bucket = key[0]
        # padding everywhere: the warm-up must not write KV through slots left by an earlier step
        self.slot_mapping.fill_(-1)
        self.token_slots.fill_(-1)
        self.input_ids.zero_()
        self.positions.zero_()
        pieces = range(self.num_pieces)
        if not self.capture_graphs:
            self._graphs[key] = [None] * self.num_pieces
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream, main = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(main)
        graphs, lora = [], None
        with torch.cuda.stream(stream):
            for i in pieces:  # compiles the Triton kernels and sets up cuBLAS outside the capture
                lora = self._piece(i, key, lora_manager, lora)
            for i in pieces:
                # capture_begin/end, not ``torch.cuda.graph``: that one synchronizes and empties the allocator's
                # caches for every graph, seconds over the thousands of pieces captured at start-up
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (pinned host copies of adapters) must not void it
                graph.capture_begin(self._pool, capture_error_mode="thread_local")
                try:
                    lora = self._piece(i, key, lora_manager, lora)
                finally:
                    graph.capture_end()
                graphs.append(graph)
        main.wait_stream(stream)
        # the LoRA step built under piece 0's capture: its metadata tensors are the ones the graphs read and write
        self._lora_steps[key] = lora
        self._graphs[key] = graphs
        log.debug("captured %d piecewise CUDA graphs: %d tokens%s", len(graphs), bucket,
                  " with adapters" if key[1] else "")
