"""Paged decode attention against torch's ``scaled_dot_product_attention(enable_gqa=True)`` on contiguous KV.

Same shapes, same data, same run: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128),
one new token per sequence. The paged kernel reads the KV through a block table whose blocks are in
random order; SDPA reads the same K/V laid out contiguously ``[B, Hkv, N, D]``. Each figure: mean time
per call, KV bytes read ÷ that time, that rate ÷ the measured copy bandwidth, and speed relative to SDPA.
With ``sweep`` the kernel's tile and split choices are tried too and the fastest is reported beside the
default (the default is what the engine runs).
"""

from __future__ import annotations

import itertools
import logging
import math

import torch
import torch.nn.functional as F

from loraplex.bench.timing import time_per_call

log = logging.getLogger(__name__)

SWEEP = {"num_splits": (1, 2, 4, 8), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}


def _paged_from_contiguous(k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int):
    """Scatter contiguous ``[B, Hkv, N, D]`` K/V into a paged pool with blocks in random order."""
    batch, kv_heads, ctx, head_dim = k.shape
    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).to(k.device, torch.int32)
    block_tables = order.view(batch, per_seq).contiguous()
    pad = per_seq * block_size - ctx

    def scatter(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, pad)).permute(0, 2, 1, 3)  # [B, N', Hkv, D]
        x = x.reshape(batch, per_seq, block_size, kv_heads, head_dim)
        pool = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=x.dtype, device=x.device)
        pool[block_tables.long()] = x
        return pool

    return scatter(k), scatter(v), block_tables


def bench_decode_case(
    batch: int, ctx: int, device: torch.device, dtype: torch.dtype, bandwidth: float,
    num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
    iters: int = 20, sweep: bool = False, warmup: int = 3, fp8_kv: bool = False,
) -> dict:
    """One decode case; with ``fp8_kv`` the paged kernel is also timed over a float8 e4m3 copy of the same cache
    (``kv_cache_dtype="fp8"``: half the bytes), against the same SDPA over the 16-bit contiguous K/V."""
    from loraplex.kernels.attention_ref import to_cache_dtype
    from loraplex.kernels.paged_attention import choose_num_splits, paged_attention_decode

    gen = torch.Generator(device=device).manual_seed(ctx)
    q = torch.randn(batch, num_q_heads, 1, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, num_kv_heads, ctx, head_dim, device=device, dtype=dtype, generator=gen)
    key_cache, value_cache, block_tables = _paged_from_contiguous(k, v, block_size, seed=ctx)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = q[:, :, 0, :].contiguous()  # [B, Hq, D]
    scale = head_dim**-0.5
    out = torch.empty_like(query)
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * k.element_size()

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def paged(**kw):
        return paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out=out, **kw)

    ref = sdpa()[:, :, 0, :].float()
    max_err = (paged().float() - ref).abs().max().item()
    t_sdpa = time_per_call(sdpa, device, iters=iters, warmup=warmup)
    t_paged = time_per_call(paged, device, iters=iters, warmup=warmup)
    row = {
        "batch": batch, "context": ctx, "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "block_size": block_size, "kv_bytes": kv_bytes,
        "num_splits": choose_num_splits(batch, num_kv_heads, None, device),
        "paged_s": t_paged, "sdpa_s": t_sdpa, "paged_over_sdpa_speed": t_sdpa / t_paged,
        "paged_GBps": kv_bytes / t_paged / 1e9, "sdpa_GBps": kv_bytes / t_sdpa / 1e9,
        "paged_frac_copy_bw": kv_bytes / t_paged / bandwidth, "sdpa_frac_copy_bw": kv_bytes / t_sdpa / bandwidth,
        "max_abs_err_vs_sdpa": max_err,
    }
    if fp8_kv:
        key8, value8 = to_cache_dtype(key_cache, torch.float8_e4m3fn), to_cache_dtype(value_cache, torch.float8_e4m3fn)

        def paged_fp8(**kw):
            return paged_attention_decode(query, key8, value8, block_tables, seq_lens, scale, out=out, **kw)

        row["fp8_max_abs_err_vs_sdpa"] = (paged_fp8().float() - ref).abs().max().item()
        t_fp8 = time_per_call(paged_fp8, device, iters=iters, warmup=warmup)
        fp8_bytes = kv_bytes // k.element_size()
        row.update({"paged_fp8_s": t_fp8, "paged_fp8_over_sdpa_speed": t_sdpa / t_fp8,
                    "paged_fp8_over_paged_speed": t_paged / t_fp8, "fp8_kv_bytes": fp8_bytes,
                    "paged_fp8_frac_copy_bw": fp8_bytes / t_fp8 / bandwidth})
    if sweep:
        row["sweep_best"] = _sweep(paged, device, iters, ref)
        row["best_over_sdpa_speed"] = t_sdpa / row["sweep_best"]["paged_s"]
        if fp8_kv and dtype == torch.bfloat16:
            row["fp8_sweep_best"] = _sweep(paged_fp8, device, iters, ref, FP8_SWEEP)
            if row["fp8_sweep_best"]:
                row["fp8_best_over_sdpa_speed"] = t_sdpa / row["fp8_sweep_best"]["paged_s"]
    return row


# the float8 cache's decode kernel: its tiles are half the bytes, and the dots may run in fp16 (f16_dots)
FP8_SWEEP = {"num_splits": (1,), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4),
             "f16_dots": (False, True)}


def _sweep(paged, device: torch.device, iters: int, ref: torch.Tensor, grid: dict | None = None) -> dict:
    best: dict | None = None
    grid = grid or SWEEP
    for values in itertools.product(*grid.values()):
        kw = dict(zip(grid, values))
        try:
            err = (paged(**kw).float() - ref).abs().max().item()
            t = time_per_call(lambda kw=kw: paged(**kw), device, iters=iters)
        except Exception as exc:  # a config the compiler rejects (e.g. too much shared memory): skip it
            log.info("sweep config %s failed: %s", kw, exc)
            continue
        if err < 5e-2 and (best is None or t < best["paged_s"]):
            best = {**kw, "paged_s": t, "max_abs_err_vs_sdpa": err}
    return best or {}


def bench_prefill_case(
    num_seqs: int, query_len: int, device: torch.device, dtype: torch.dtype, num_q_heads: int = 32,
    num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16, iters: int = 20, warmup: int = 3,
) -> dict:
    """Fresh causal prefill (no cached prefix, so SDPA's ``is_causal`` means the same thing)."""
    from loraplex.kernels.paged_attention import paged_attention

    gen = torch.Generator(device=device).manual_seed(query_len)
    shape = (num_seqs, num_kv_heads, query_len, head_dim)
    q = torch.randn(num_seqs, num_q_heads, query_len, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    key_cache, value_cache, block_tables = _paged_from_contiguous(k, v, block_size, seed=query_len)
    query = q.permute(0, 2, 1, 3).reshape(num_seqs * query_len, num_q_heads, head_dim).contiguous()
    seq_lens = torch.full((num_seqs,), query_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * query_len
    scale = head_dim**-0.5
    out = torch.empty_like(query)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=True)

    def paged():
        return paged_attention(query, key_cache, value_cache, block_tables, qsl, seq_lens, scale, out=out,
                               max_query_len=query_len)

    ref = sdpa().permute(0, 2, 1, 3).reshape_as(query).float()
    max_err = (paged().float() - ref).abs().max().item()
    t_sdpa = time_per_call(sdpa, device, iters=iters, warmup=warmup)
    t_paged = time_per_call(paged, device, iters=iters, warmup=warmup)
    flops = 4 * num_seqs * num_q_heads * head_dim * query_len * (query_len + 1) / 2  # causal QK^T and PV
    return {"num_seqs": num_seqs, "query_len": query_len, "paged_s": t_paged, "sdpa_s": t_sdpa,
            "paged_over_sdpa_speed": t_sdpa / t_paged, "paged_TFLOPs": flops / t_paged / 1e12,
            "sdpa_TFLOPs": flops / t_sdpa / 1e12, "max_abs_err_vs_sdpa": max_err}


def run_attention_bench(
    device: torch.device, batch: int = 64, contexts: tuple[int, ...] = (1024, 2048, 4096),
    dtype: torch.dtype = torch.bfloat16, iters: int = 20, sweep: bool = False, bandwidth: float | None = None,
    warmup: int = 3, prefill: tuple[int, int] | None = (8, 2048), fp8_kv: bool = False, **shape,
) -> dict:
    """Decode cases at ``contexts``; plus, with ``prefill = (num_seqs, query_len)``, one fresh prefill case."""
    from loraplex.bench.roofline import measure_copy_bandwidth

    if bandwidth is None:
        bandwidth = measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 24)
    rows = [bench_decode_case(batch, ctx, device, dtype, bandwidth, iters=iters, sweep=sweep, warmup=warmup,
                              fp8_kv=fp8_kv, **shape)
            for ctx in contexts]
    result = {"copy_bandwidth_Bps": bandwidth, "decode": rows}
    if prefill:
        result["prefill"] = [bench_prefill_case(*prefill, device, dtype, iters=iters, warmup=warmup, **shape)]
    return result
