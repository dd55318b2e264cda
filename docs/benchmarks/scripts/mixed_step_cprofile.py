"""cProfile of eager mixed steps (run 11, call B): ``loraplex bench step-profile`` with every timed step after the first
PROF_SKIP (default 8) under cProfile, one profile per adapter count, written to $OUT/cprof-<adapters>.{txt,prof},
and the timed steps' wall times printed (cProfile roughly doubles Python's cost: read shares, not times).

    OUT=/tmp/cprof python3 docs/benchmarks/scripts/mixed_step_cprofile.py [more step-profile flags, e.g. --smoke]
"""

import cProfile
import io
import os
import pstats
import sys

from loraplex.bench import instrument
from loraplex.bench import step_profile as sp
from loraplex.cli import main

OUT = os.environ["OUT"]
SKIP = int(os.environ.get("PROF_SKIP", "8"))
state = {"n": 0, "prof": None}
timed_step = instrument.PhaseTimers.step
profile_run = sp.profile_decode_steps
phase_summary = sp._phase_summary


def step(self):
    state["n"] += 1
    if state["prof"] is None or state["n"] <= SKIP:
        return timed_step(self)
    state["prof"].enable()
    try:
        return timed_step(self)
    finally:
        state["prof"].disable()


def profile_decode_steps(llm, batch, context, num_adapters, *args, **kwargs):
    state["prof"], state["n"] = cProfile.Profile(), 0
    result = profile_run(llm, batch, context, num_adapters, *args, **kwargs)
    text = io.StringIO()
    stats = pstats.Stats(state["prof"], stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    with open(f"{OUT}/cprof-{num_adapters}.txt", "w") as f:
        f.write(text.getvalue())
    stats.dump_stats(f"{OUT}/cprof-{num_adapters}.prof")
    return result


def summary(records, calls):
    print("== per-step ms:", [round(r["step"] * 1e3, 1) for r in records])
    print("== forward launch ms:", [round(r.get("forward launch", 0) * 1e3, 1) for r in records])
    return phase_summary(records, calls)


instrument.PhaseTimers.step = step
sp.profile_decode_steps = profile_decode_steps
sp._phase_summary = summary
sys.exit(main(["bench", "step-profile", "--out-dir", OUT, "--adapters", "0,64", "--steps", "48", "--profile-steps", "1",
               "--step-prompt-tokens", "384", "--batch", "248", "--context", "256"] + sys.argv[1:]))
