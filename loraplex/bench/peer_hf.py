"""The peer: Hugging Face transformers + PEFT, mixed-adapter ``generate`` on the same GPU, model and adapters.

Several adapters are loaded into one ``PeftModel``; each batch row names its adapter through
``generate(..., adapter_names=[...])`` (PEFT's mixed-batch LoRA inference). Prompts have one length so
no padding is needed; ``min_new_tokens = max_new_tokens`` makes every row produce the full output, as
``ignore_eos`` does for loraplex. Throughput = generated tokens ÷ wall time of the ``generate`` calls.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def run_hf_peft(
    model_dir: str | Path, adapter_dirs: list[Path], device: torch.device, dtype: torch.dtype,
    num_requests: int, batch_size: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":  # load straight onto the GPU
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map=str(device))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    names = [f"a{i}" for i in range(len(adapter_dirs))]
    model = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name=names[0])
    for name, path in zip(names[1:], adapter_dirs[1:]):
        model.load_adapter(str(path), adapter_name=name)
    model.eval()
    rng = random.Random(seed)
    elapsed = 0.0
    generated = 0
    try:
        for start in range(0, num_requests, batch_size):
            rows = min(batch_size, num_requests - start)
            ids = torch.tensor([[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(rows)],
                               device=device)
            adapter_names = [names[(start + r) % len(names)] for r in range(rows)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=adapter_names,
                                     max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                     pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed += time.perf_counter() - t0
            generated += (out.shape[1] - input_len) * rows
            log.info("hf-peft batch of %d: %.1f s", rows, time.perf_counter() - t0)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "peer": "hf-peft", "num_requests": num_requests, "batch_size": batch_size, "num_adapters": len(names),
        "input_len": input_len, "output_len": output_len, "output_tokens": generated, "elapsed_s": elapsed,
        "output_tok_per_s": generated / elapsed if elapsed else None,
    }
