# bisect helper (not part of the project): base decode step at batch 64, context 1024, in the tree on sys.path
import sys, time, torch
from pathlib import Path
from loraplex.bench.llama8b import RandomModelSpec, write_random_model
from loraplex.bench.offline import make_llm, measure_decode_step
tag = sys.argv[1]
t0 = time.time()
d = write_random_model(Path("/tmp/lpx-bisect/m32"), RandomModelSpec(num_layers=32), torch.device("cuda"))
llm = make_llm(d, "cuda", "bfloat16", 256, 16, max_num_seqs=256, seed=0)
res = []
for rep in range(3):
    r = measure_decode_step(llm, 64, 1024, 48, 128256, [], distinct_adapters=False, seed=rep + 1)
    res.append(r["step_median_s"] * 1e3)
print(f"BISECT {tag}: median ms per base decode step (3 reps) {[round(x, 2) for x in res]}, {time.time() - t0:.0f} s",
      flush=True)
