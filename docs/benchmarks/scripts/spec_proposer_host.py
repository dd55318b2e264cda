"""Host cost of prompt-lookup drafts per engine step: 256 sequences, contexts of 512-4,096 random tokens (vocab
32,000), each growing by one token per step, proposals keyed by sequence (the scheduler's incremental arrays).
Run: python docs/benchmarks/scripts/spec_proposer_host.py"""

import random
import time

from loraplex.engine.spec_decode import NgramProposer

rng = random.Random(0)
for ctx_len in (512, 2048, 4096):
    seqs = [[rng.randrange(32000) for _ in range(ctx_len)] for _ in range(256)]
    p = NgramProposer(4, 2, 4)
    for i, s in enumerate(seqs):  # the first call builds each array
        p.propose(s, key=i)
    times = []
    for _ in range(20):
        for s in seqs:
            s.append(rng.randrange(32000))
        t = time.perf_counter()
        for i, s in enumerate(seqs):
            p.propose(s, key=i)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"context {ctx_len}: 256 sequences, median {times[10] * 1e3:.2f} ms per step "
          f"({times[10] / 256 * 1e6:.1f} us per sequence)")
