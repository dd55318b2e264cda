"""Keep Python's cyclic garbage collector off the heap that lives as long as the process.

After the engine has loaded, hundreds of thousands of objects (modules, the model's and the tokenizer's Python
objects, the web framework) stay alive for good, and every full (oldest-generation) collection walks all of them:
measured on a 2-core CPU, one such collection during a generate took 183 ms with the heap as loaded and 8 ms after
``freeze_heap`` (docs/benchmarks/gc-freeze-cpu.md). A pause of that length stops the engine loop and the HTTP
event loop alike. ``gc.freeze`` moves every object alive now into a permanent generation that collections skip;
reference counting still frees them, only cycles among them are no longer collected until ``unfreeze_heap``.
For processes that exist to run the engine (``loraplex serve``, the benchmarks), not for a library caller's heap.
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect what is garbage now, then freeze everything still alive; returns the number of frozen objects.

    At exit the heap is unfrozen again, so the interpreter's last collections reach the cycles that were alive at
    the freeze: frozen, those outlive the teardown of their extension modules (Triton's nanobind module then lists
    hundreds of "leaked" instances, types and functions on stderr at every shutdown)."""
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: %d objects alive after start-up moved out of the collector's reach (gc.freeze)", frozen)
    return frozen


def unfreeze_heap() -> None:
    """Undo ``freeze_heap`` (before dropping what was alive at the freeze, e.g. a failed engine)."""
    gc.unfreeze()
