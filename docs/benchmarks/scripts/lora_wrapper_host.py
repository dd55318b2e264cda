"""Host cost of our LoRA launch wrappers per projection (``LoRAStep.add``: views, configs, argument checks and
lists), with the two Triton launches replaced by no-ops, on CPU tensors of a Llama-like layer: what an eager step
pays in Python for each of its 128 LoRA'd projections (32 layers x 4) besides Triton's own launch work.

    .venv/bin/python docs/benchmarks/scripts/lora_wrapper_host.py [--tokens 632] [--adapters 64] [--calls 8000]
"""

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "0")  # the wrappers' compiled-launch branch (PDL, tables) as on a GPU

import torch  # noqa: E402

from loraplex.adapters.mapping import LoRAStep  # noqa: E402
from loraplex.adapters.modules import PROJ_MODULES, BaseShapes  # noqa: E402
from loraplex.kernels import lora_expand, lora_shrink, lora_testing  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=632)  # run 11's mixed step: 248 decodes + a 384-token prompt
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--calls", type=int, default=8000)
    args = p.parse_args()
    lora_shrink._lora_shrink_kernel = _NoLaunch()
    lora_expand._lora_expand_kernel = _NoLaunch()
    shapes = BaseShapes(num_layers=4, hidden_size=512, q_size=512, kv_size=128, intermediate_size=1792)
    pool, _ = lora_testing.random_slot_pool(shapes, args.adapters, 16, "cpu", torch.bfloat16)
    slots = torch.arange(args.tokens, dtype=torch.int32) % args.adapters
    step = LoRAStep(pool, slots, args.adapters, use_triton=True)
    xs = {p: torch.randn(args.tokens, shapes.proj_in(p), dtype=torch.bfloat16) for p in PROJ_MODULES}
    outs = {p: torch.randn(args.tokens, sum(shapes.slice_widths(p)), dtype=torch.bfloat16) for p in PROJ_MODULES}
    calls = [(layer, p) for layer in range(4) for p in PROJ_MODULES]
    for layer, proj in calls * 50:
        step.add(layer, proj, xs[proj], outs[proj])
    rounds = max(1, args.calls // len(calls))
    started = time.perf_counter()
    for _ in range(rounds):
        for layer, proj in calls:
            step.add(layer, proj, xs[proj], outs[proj])
    elapsed = time.perf_counter() - started
    n = rounds * len(calls)
    print(f"LoRAStep.add without the launches: {elapsed / n * 1e6:.1f} us per projection ({n} calls, "
          f"{args.tokens} tokens, {args.adapters} adapters, torch {torch.__version__})")


if __name__ == "__main__":
    main()
