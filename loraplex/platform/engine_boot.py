"""Start the engine for ``loraplex serve``: the demo model on first run, engine knobs from Settings.

The engine's step loop runs in a child process of its own (``ProcessEngine``; with ``engine_process`` off, in a
thread of the server: ``AsyncEngine``), so the HTTP event loop never stalls a step; loading happens off the event
loop too, and ``/ready`` stays 503 until it is done.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from loraplex.engine.gc_heap import freeze_heap, unfreeze_heap
from loraplex.settings import Settings

log = logging.getLogger(__name__)


def demo_model_dir(settings: Settings) -> Path:
    from loraplex.platform.app import DEMO_MODEL_DIR

    return settings.data_path / DEMO_MODEL_DIR


def ensure_model(settings: Settings) -> Path:
    """The model directory to serve; generates the demo model (and adapters) on first run."""
    if settings.model:
        path = Path(settings.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    out = demo_model_dir(settings)
    if not (out / "loraplex_demo.json").is_file():
        from loraplex.demo import build_demo_model

        log.info("generating the demo model and adapters in %s (first run)", out)
        build_demo_model(out)
    return out


def engine_config(settings: Settings, model_dir: Path, model_id: str):
    from loraplex.engine.config import EngineConfig

    device = settings.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model=str(model_dir), model_id=model_id, device=device, dtype=settings.dtype,
        block_size=settings.block_size, num_kv_blocks=settings.num_kv_blocks, kv_cache_dtype=settings.kv_cache_dtype,
        quantization=settings.quantization or None, tensor_parallel_size=settings.tensor_parallel_size,
        num_speculative_tokens=settings.num_speculative_tokens, prompt_lookup_min=settings.prompt_lookup_min,
        prompt_lookup_max=settings.prompt_lookup_max,
        gpu_memory_utilization=settings.gpu_memory_utilization, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
        enable_lora=settings.enable_lora, max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras, lora_load_workers=settings.lora_load_workers,
        merge_single_lora=settings.merge_single_lora and settings.enable_lora,
        loop_torch_threads=settings.loop_torch_threads,
        prefill_batch_min_tokens=settings.prefill_batch_min_tokens,
        prefill_batch_max_wait_steps=settings.prefill_batch_max_wait_steps,
        prefill_batch_min_running=settings.prefill_batch_min_running,
        attention_decode_split=settings.attention_decode_split,
        piecewise_cuda_graphs=settings.piecewise_cuda_graphs,
        lora_expand_first_min_tokens=settings.lora_expand_first_min_tokens,
        lora_segment_tiles=settings.lora_segment_tiles,
        lora_gemm_shrink=settings.lora_gemm_shrink,
        lora_gemm_shrink_max_tokens=settings.lora_gemm_shrink_max_tokens,
        lora_gemm_shrink_max_moves=settings.lora_gemm_shrink_max_moves,
    )


def build_engine(settings: Settings, model_id: str, freeze_gc: bool = False):
    """Blocking: load weights and start the engine's loop (its process, or its thread). ``freeze_gc``: the engine
    process freezes its own heap once loaded (``gc_heap``; a thread's heap is the server's, frozen by the caller)."""
    config = engine_config(settings, ensure_model(settings), model_id)
    if settings.engine_process:
        from loraplex.engine.engine_process import ProcessEngine

        return ProcessEngine.from_config(config, freeze_gc=freeze_gc)
    from loraplex.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(config)


async def start_engine_in_background(services) -> None:
    """Start the engine off the event loop, then supervise it for the life of the app.

    An engine whose step loop died (a device fault, a bug) has already ended its streams with an error
    event; an engine process that has sent nothing for ``engine_stall_timeout_s`` (a hung device, a stopped or
    deadlocked process) is killed, which ends its streams the same way. The supervisor drops it, waits (exponential backoff from ``engine_restart_delay_s``, up to a
    minute) and loads a fresh one, so the replica recovers by itself. ``/ready`` is 503 meanwhile and new
    requests get a fast 503. A failure of the very first start is a configuration problem: not retried.
    """
    settings = services.settings
    delay = settings.engine_restart_delay_s
    first = True
    while True:
        try:
            engine = await asyncio.to_thread(build_engine, settings, services.base_model_id, services.freeze_gc)
        except Exception as exc:
            log.exception("the engine failed to start")
            services.engine_error = f"{type(exc).__name__}: {exc}"
            if first:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_RESTART_DELAY_S)
            continue
        first = False
        services.engine, services.engine_error = engine, None
        log.info("engine ready: model %s, max_model_len %s", engine.model_id, engine.max_model_len)
        if services.freeze_gc:
            freeze_heap()
        healthy_since = asyncio.get_running_loop().time()
        while engine.is_healthy():
            await asyncio.sleep(_WATCH_INTERVAL_S)
            silent, stall = engine_silent_s(engine), settings.engine_stall_timeout_s
            if stall and silent > stall:
                log.error("the engine has sent nothing for %.0f s (engine_stall_timeout_s %g): killing it", silent,
                          stall)
                engine.kill(f"the engine stopped answering (nothing from it for {silent:.0f} s) and was killed")
        if asyncio.get_running_loop().time() - healthy_since > _MAX_RESTART_DELAY_S:
            delay = settings.engine_restart_delay_s  # it ran fine for a while: start the backoff over
        services.engine = None
        services.engine_restarts += 1
        log.error("the engine loop died; loading a new engine in %.1f s (restart %d)", delay,
                  services.engine_restarts)
        await engine.shutdown()
        if services.freeze_gc:
            unfreeze_heap()  # the dead engine's objects were frozen with the rest: let the collector have them
        del engine
        _release_device_memory()
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_RESTART_DELAY_S)


_WATCH_INTERVAL_S = 0.25


def engine_silent_s(engine) -> float:
    """Seconds since the engine process last sent anything (``ProcessEngine.silent_s``); 0 for the thread engine,
    whose loop shares this process and cannot be killed on its own."""
    silent_s = getattr(engine, "silent_s", None)
    return silent_s() if silent_s is not None else 0.0
_MAX_RESTART_DELAY_S = 60.0


def _release_device_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 (best effort: the next load reports real problems)
        log.debug("could not release device memory", exc_info=True)
