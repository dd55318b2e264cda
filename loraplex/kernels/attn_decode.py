"""Triton paged decode attention: split-KV (flash-decoding) with the GQA group in one ``tl.dot``.

Semantics (twin: ``attention_ref.paged_attention_ref`` with one new token per sequence)::

    for b, kv_head h_kv, query head h = h_kv * g + j (j < g = Hq // Hkv):
        N = seq_lens[b]; K_b, V_b = the first N cached keys/values of b (through block_tables[b])
        out[b, h] = softmax(scale * q[b, h] . K_b[:, h_kv]) @ V_b[:, h_kv]        (fp32 math)

    split s of S covers keys [s * C, min((s + 1) * C, N)), C = ceil(ceil(N / S) / BLOCK_N) * BLOCK_N:
        o_s = softmax over the split @ V,  lse_s = log2 sum_j 2^(x_j)  with x = scale * log2(e) * q.k
        out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),  m = max_s lse_s;  empty split: lse_s = -inf

Shape:
    query:                    [B, Hq, D]
    key_cache, value_cache:   [num_blocks, block_size, Hkv, D]
    block_tables:             [B, max_blocks_per_seq] int32
    seq_lens:                 [B] int32   (keys including the new token; 0 gives a zero output)
    out:                      [B, Hq, D]
    partial_out (S > 1):      [B, Hq, S, D] fp32;  partial_lse: [B, Hq, S] fp32

Grid ``(B, Hkv, S)``: one program per (sequence, KV head, split) reads each K/V tile once for the
whole GQA group; the group's query heads are the rows of the ``tl.dot`` (padded to 16 rows). ``S`` is
fixed by the host from shapes (batch, heads and, when the caller knows it, the longest context), never
from device values, so a CUDA graph captured at one batch size replays correctly for any contexts.
A float8 e4m3 cache (scale 1) is read as such and its tiles converted to the query's dtype after the loads
(exact), so the dots and the softmax are those of a 16-bit cache; only the stored values were rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch

LOG2E = 1.4426950408889634
# defaults of the decode kernel (``loraplex bench attention --sweep`` measures the alternatives); three
# stages also prefetch the block-table entries, not only the K/V tiles
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# over a float8 cache under bf16 queries: the fastest of `bench attention --sweep --fp8-kv` on the H200 at batch 64,
# contexts 1,024-4,096 (run 15, docs/benchmarks/H200-2026-12-03-run15.md): 128-key tiles, two stages, fp16 dots;
# 76 / 141 / 274 us against 108 / 201 / 390 with the 16-bit defaults (the bf16 cache: 72 / 134 / 256)
FP8_BLOCK_N = 128
FP8_NUM_STAGES = 2


@triton.jit
def kv_tile(q, t, t_mask, d, d_mask, block_table_row, kv_head, key_cache_ptr, value_cache_ptr, key_scale_ptr,
            value_scale_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, qk_scale,
            BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_INT8: tl.constexpr):
    """For the keys at positions ``t`` (``t_mask``: which exist) of one KV head (program axis 1) through its
    sequence's block-table row: the scores ``q . K^T * qk_scale`` [rows, BLOCK_N] in log2 units (each key row
    times its scale in an INT8 cache), the value tile [BLOCK_N, BLOCK_D] in q's dtype, and the value rows'
    scales (1.0 outside an INT8 cache). Shared by the decode and the varlen kernel."""
    block_ids = tl.load(block_table_row + t // block_size, mask=t_mask, other=0).to(tl.int64)
    in_block = (t % block_size).to(tl.int64)
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(
        key_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks
        + kv_head * stride_kh + d[None, :],
        mask=kv_mask, other=0.0,
    ).to(q.dtype)  # a float8 cache: exact in 16-bit, so the dots run as for a 16-bit cache
    v = tl.load(
        value_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs
        + kv_head * stride_vh + d[None, :],
        mask=kv_mask, other=0.0,
    ).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if KV_INT8:  # each key row times its scale; each value row's scale folded into its probability
        scale_row = (block_ids * block_size + in_block) * tl.num_programs(1) + kv_head
        s = s * tl.load(key_scale_ptr + scale_row, mask=t_mask, other=0.0)[None, :]
        v_scale = tl.load(value_scale_ptr + scale_row, mask=t_mask, other=0.0)
    else:
        v_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return s, v, v_scale


@triton.jit
def accumulate_tile(acc, l_i, m_i, m_ref, s, v, v_scale, DOT_PRECISION: tl.constexpr, KV_INT8: tl.constexpr):
    """One online-softmax step: (acc, l) rescaled from the running max ``m_i`` to ``m_ref`` (finite), plus the
    tile's probabilities ``exp2(s - m_ref)`` and their sum over the value tile."""
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_INT8:
        pv = p * v_scale[None, :]
    else:
        pv = p
    acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i


@fast_launch
@triton.jit(do_not_specialize=["stride_bt"])  # the step's block-table width: 16-divisible or not, one variant
def _decode_split_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,  # INT8 cache: fp32 [num_blocks, block_size, Hkv] row scales (else unused)
    value_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, Hq, D], written when NUM_SPLITS == 1
    part_out_ptr,  # [B, Hq, S, D] fp32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [B, Hq, S] fp32
    qk_scale,  # scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr = False,
    F16_DOTS: tl.constexpr = False,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F16_DOTS:
        # a float8 cache under bf16 queries: the dots in fp16 (e4m3 -> fp16 is one conversion per pair of values;
        # a bf16 query in fp16 keeps more mantissa, its range is far inside fp16's)
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        t = tile_start + tl.arange(0, BLOCK_N)
        t_mask = t < end
        s, v, v_scale = kv_tile(q, t, t_mask, d, d_mask, block_table_row, kv_head, key_cache_ptr, value_cache_ptr,
                                key_scale_ptr, value_scale_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                stride_vh, block_size, qk_scale, BLOCK_N, DOT_PRECISION, KV_INT8)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has >= 1 valid key
        acc, l_i = accumulate_tile(acc, l_i, m_i, m_new, s, v, v_scale, DOT_PRECISION, KV_INT8)
        m_i = m_new

    has_keys = l_i > 0.0  # False only for an empty split (or seq_len 0): no 0/0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        part_row = (b * num_q_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


@fast_launch
@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, S, D] fp32
    part_lse_ptr,  # [B, Hq, S] fp32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights below are all 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_attention_decode(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,  # None: DEFAULT_BLOCK_N, or FP8_BLOCK_N over a float8 cache
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int | None = None,  # None: DEFAULT_NUM_STAGES, or FP8_NUM_STAGES over a float8 cache
    key_scale: torch.Tensor | None = None,  # INT8 cache: [num_blocks, block_size, Hkv] fp32 row scales
    value_scale: torch.Tensor | None = None,
    f16_dots: bool | None = None,  # float8 cache, bf16 query: the dots in fp16 (None: exactly then)
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV (see module doc).

    ``num_splits`` defaults to :func:`choose_num_splits` of the shapes (and ``max_seq_len`` when the
    caller knows it on the host; ignored during CUDA-graph capture). Any split count is correct for any
    ``seq_lens``: it only changes how the keys are partitioned. No host-device sync.
    """
    batch, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} not a multiple of Hkv {num_kv_heads}"
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    int8 = check_kv_cache(query, key_cache, value_cache, key_scale, value_scale)
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    block_n = block_n or (FP8_BLOCK_N if fp8 else DEFAULT_BLOCK_N)
    num_stages = num_stages or (FP8_NUM_STAGES if fp8 else DEFAULT_NUM_STAGES)
    if f16_dots is None:
        f16_dots = fp8 and query.dtype == torch.bfloat16
    assert not f16_dots or (key_cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16), (
        "f16_dots: a float8 cache under bf16 queries only")
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == batch
    assert block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        if max_seq_len is not None and query.is_cuda and torch.cuda.is_current_stream_capturing():
            max_seq_len = None  # a captured graph replays at other lengths: size the splits for long ones
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, query.device)
    block_d = max(16, next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, key_scale if int8 else key_cache, value_scale if int8 else value_cache,
        block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_size,
        GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, KV_INT8=int8, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(query.dtype),
        F16_DOTS=f16_dots, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits), num_warps=4,
        )
    return out


def check_kv_cache(query, key_cache, value_cache, key_scale, value_scale) -> bool:
    """The cache's element type against the query's: the same 16-bit/fp32 type, float8 e4m3, or int8 with its row
    scales ([num_blocks, block_size, Hkv] fp32, contiguous). True for an INT8 cache."""
    assert key_cache.dtype == value_cache.dtype, f"KV cache {key_cache.dtype} / {value_cache.dtype}"
    if key_cache.dtype == torch.int8:
        assert key_scale is not None and value_scale is not None, "an INT8 KV cache needs key_scale and value_scale"
        assert key_scale.shape == value_scale.shape == key_cache.shape[:3], (
            f"scales {tuple(key_scale.shape)} for a cache {tuple(key_cache.shape)}")
        assert key_scale.dtype == value_scale.dtype == torch.float32
        assert key_scale.is_contiguous() and value_scale.is_contiguous()
        return True
    assert key_cache.dtype in (query.dtype, torch.float8_e4m3fn), (
        f"KV cache {key_cache.dtype} / {value_cache.dtype} with query {query.dtype}")
    return False


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (tl.dot would use tf32 on the GPU); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


_SM_COUNT: dict[int, int] = {}
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int | None = None, device: torch.device | None = None
) -> int:
    """One split once ``batch * Hkv`` programs cover the SMs twice (no merge pass, long streams per
    program); below that, enough splits for about four programs per SM, each split >= 256 keys.

    H200 run 1 (batch 64, 8 KV heads, 2 splits): 81 % of the copy bandwidth at context 1,024 but 98 % at
    4,096, i.e. per-program and merge overheads, not streaming, cost the short contexts; FlashAttention's
    split heuristic also keeps one split when the programs already fill the GPU.
    Depends on host-known numbers only; with ``max_seq_len=None`` it assumes long contexts.
    """
    num_sms = _sm_count(device) if device is not None else 132
    programs = max(1, batch * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    splits = max(1, min(MAX_SPLITS, cdiv(4 * num_sms, programs)))
    if max_seq_len is not None:
        splits = max(1, min(splits, cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)))
    return next_power_of_2(splits) if splits > 1 else 1


def num_splits_cases(max_batch: int, num_kv_heads: int, max_seq_len: int,
                     device: torch.device | None = None) -> dict[int, tuple[int, int]]:
    """Every split count ``choose_num_splits`` returns for batches of 1..``max_batch`` sequences whose longest has
    up to ``max_seq_len`` keys, each with the first (batch, longest length) that gets it: each count is a kernel
    variant (``NUM_SPLITS`` is a constexpr), which a start-up warm-up compiles once rather than inside a request."""
    lengths = sorted({min(k * MIN_KEYS_PER_SPLIT, max_seq_len)
                      for k in range(1, cdiv(max(1, max_seq_len), MIN_KEYS_PER_SPLIT) + 1)})
    cases: dict[int, tuple[int, int]] = {}
    for batch in range(1, max_batch + 1):
        for length in lengths:
            cases.setdefault(choose_num_splits(batch, num_kv_heads, length, device), (batch, length))
    return cases
