"""``freeze_gc``: the engine's start-up heap is frozen out of the cyclic GC (in a child process: freezing the test
runner's own heap would keep every later test's garbage cycles among today's objects alive)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r'''
import gc, sys
from loraplex import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=4, freeze_gc=sys.argv[2] == "1")
frozen = gc.get_freeze_count()
out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(frozen, len(out[0].outputs[0].token_ids))
'''


def _run(model_dir: str, freeze: bool) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, "-c", CHILD, model_dir, "1" if freeze else "0"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    frozen, tokens = proc.stdout.split()
    return int(frozen), int(tokens)


def test_freeze_gc_freezes_the_start_up_heap_and_the_engine_still_runs(tiny_model):
    frozen, tokens = _run(tiny_model["model_dir"], freeze=True)
    assert frozen > 10_000 and tokens == 4  # torch, transformers and the engine: far more than a few objects
    assert _run(tiny_model["model_dir"], freeze=False) == (0, 4)  # off by default for a library caller


def test_a_frozen_heap_is_unfrozen_at_exit_so_extension_modules_tear_down_quietly():
    # frozen cycles outlive the interpreter's last collections; Triton's nanobind module then reports hundreds of
    # "leaked" instances, types and functions on stderr at every exit of a server that froze its heap
    child = "import triton.language\nfrom loraplex.engine.gc_heap import freeze_heap\nfreeze_heap()\n"
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[:500]
