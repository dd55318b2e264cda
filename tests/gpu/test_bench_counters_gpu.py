"""The offline bench's Triton compile counter on CUDA: a kernel run at a new specialization adds a compiled
variant, the same call again adds none (so a rise inside a timed window means compiles were timed).

The kernel is this module's own, so no other test can have compiled its variants first."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _scale_kernel(x_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


def _run(x: torch.Tensor, scale: float) -> None:
    _scale_kernel[(triton.cdiv(x.numel(), 128),)](x, x.numel(), SCALE=scale, BLOCK=128)
    torch.cuda.synchronize()


def test_compile_counter_rises_once_per_new_variant():
    from loraplex.bench.instrument import triton_compiled_kernels

    assert triton_compiled_kernels() >= 0  # our kernels' caches are where the counter looks
    x = torch.ones(1000, device="cuda")
    before = triton_compiled_kernels(__name__)
    assert before == 0
    _run(x, 2.0)
    assert triton_compiled_kernels(__name__) == 1
    _run(x, 2.0)  # same specialization: no compile
    assert triton_compiled_kernels(__name__) == 1
    _run(x, 3.0)  # a new constexpr: one more variant
    assert triton_compiled_kernels(__name__) == 2
    assert torch.equal(x, torch.full_like(x, 12.0))


def test_engine_start_up_leaves_no_attention_variant_to_compile_in_mixed_steps(tiny_model):
    """After start-up (decode graphs and the eager warm-up), steps that mix decodes with prompt chunks compile no
    attention kernel: the decode rows' split counts (sized for the step's longest sequence, here up to 700 keys)
    were warmed up, and the varlen part's lengths and block rows come as tensors of their own, not slices 1-3 rows
    in (another 16-byte alignment: another variant). The schedule (64-token budget): 1, 2, 4, 5 decode rows."""
    from loraplex import SamplingParams
    from loraplex.bench.instrument import new_compiled_variants, triton_compiled_variants
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine_core import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], device="cuda", dtype="bfloat16",
                                    max_num_batched_tokens=64, max_num_seqs=16))
    before = triton_compiled_variants("loraplex.kernels.attn")
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate([300, 20, 700, 5, 450, 9]):  # decodes join chunked prompts: 1, 2, 3, ... decode rows
        engine.add_request(f"r{i}", [1] + torch.randint(8, 500, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    runner, decode_rows = engine.runner, []
    metadata = runner._attention_metadata

    def recorded(batch):  # what each step held: its decode rows, in a step with prompt tokens
        if batch.max_query_len > 1:
            decode_rows.append((batch.num_decodes, batch.max_seq_len))
        return metadata(batch)

    runner._attention_metadata = recorded
    while engine.has_unfinished_requests():
        engine.step()
    # decode rows at offsets that are not 16-byte aligned, beside sequences longer than two splits' worth of keys
    assert any(d % 4 for d, _ in decode_rows) and max(n for d, n in decode_rows if d) > 512
    assert new_compiled_variants(before, triton_compiled_variants("loraplex.kernels.attn")) == []


def test_engine_start_up_leaves_no_lora_variant_to_compile_in_prompt_steps(tiny_model):
    """After start-up, prompt steps on many adapters compile no LoRA kernel: the warm-up ran one pass per compile key
    a step can have (``mapping.warmup_steps``). The first step here is 4,096 tokens on ~45 adapters of ~90 tokens
    each (prefill tiles), first with base requests among them and then without (expand-first zeroes base rows or
    not); decode and mixed steps follow. The H200 report of 2026-12-07 compiled a shrink and an expand in the
    distinct workload's prompt steps under the former warm-up (1 and max_loras adapters only)."""
    from loraplex import LoRARequest, SamplingParams
    from loraplex.bench.instrument import new_compiled_variants, triton_compiled_variants
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine_core import LLMEngine
    from tests.conftest import adapter_dir

    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], device="cuda", dtype="bfloat16", enable_lora=True,
                                    max_loras=64, max_lora_rank=64, max_num_batched_tokens=4096, max_num_seqs=64))
    before = triton_compiled_variants("loraplex.kernels.lora")
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    num_files = len(tiny_model["adapters"])
    for wave, with_base in enumerate((True, False)):
        for i in range(50):
            lora = None if with_base and i % 6 == 0 else LoRARequest(f"w{wave}a{i}", 100 * wave + i + 1,
                                                                     adapter_dir(tiny_model, i % num_files))
            engine.add_request(f"w{wave}r{i}", [1] + torch.randint(8, 500, (89,), generator=gen).tolist(), params,
                               lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
    assert new_compiled_variants(before, triton_compiled_variants("loraplex.kernels.lora")) == []
