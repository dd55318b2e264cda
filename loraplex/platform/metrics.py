"""Prometheus metrics: vLLM's names where one exists, plus per-tenant counters.

One registry per app (tests build many apps in one process). Engine gauges are read from
``EngineClient.stats()`` at scrape time, so they are never stale and cost nothing per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.engine.protocol import EngineStats

# Litestar appends "; charset=utf-8" to every text/* media type: naming it here too sent it twice, which
# Prometheus 3 refuses (the scrape fails on a Content-Type Go cannot parse)
CONTENT_TYPE = "text/plain; version=0.0.4"

# prometheus_client also exports a ``*_created`` series (start time) beside every counter and histogram: one more
# series per label set, which Prometheus's own ``rate()``/``increase()`` never read. The switch is process-wide
# (this module is the process's one metrics registry); the same as PROMETHEUS_DISABLE_CREATED_SERIES=true.
disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    def __init__(self, model_name: Callable[[], str], stats: Callable[[], EngineStats | None], max_loras: int):
        self._model_name, self._stats, self._max_loras = model_name, stats, max_loras

    def collect(self):
        stats = self._stats() or EngineStats()
        labels = ["model_name"]
        model = [self._model_name()]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", stats.kv_cache_usage),
            ("vllm:prefix_cache_hit_rate", "Prefix cache hit rate.", stats.prefix_cache_hit_rate),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, float(value))
            yield g
        for name, doc, value in (
            ("vllm:num_preemptions", "Sequences preempted (recomputed later) since start.", stats.num_preemptions),
            ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified since start.",
             stats.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted since start.",
             stats.spec_accepted_tokens),
            ("loraplex:lora_slot_loads", "Adapter copies into a GPU slot since start.", stats.num_lora_loads),
            ("loraplex:lora_slot_evictions", "Adapters displaced from a GPU slot since start.", stats.num_lora_evictions),
            ("loraplex:lora_host_loads", "Adapter files read and validated into host memory since start.",
             stats.num_lora_host_loads),
            ("loraplex:lora_load_failures", "Adapter reads that failed validation or I/O since start.",
             stats.num_lora_load_failures),
            ("loraplex:lora_host_load_seconds", "Seconds spent reading and validating adapter files.",
             stats.lora_host_load_seconds),
            ("loraplex:lora_merges", "Adapters folded into the base weights (merge_single_lora) since start.",
             stats.num_lora_merges),
            ("loraplex:lora_merged_steps", "Engine steps run on merged weights since start.",
             stats.num_lora_merged_steps),
            ("loraplex:engine_loop_steps", "Steps the engine loop (its thread or process) ran since start.", stats.loop_steps),
            ("loraplex:engine_loop_step_seconds", "Seconds the engine loop spent inside its steps.",
             stats.loop_step_seconds),
            ("loraplex:engine_loop_step_cpu_seconds",
             "CPU seconds of the engine loop's own thread inside its steps (the rest of a step is waiting: for the "
             "device, or, in a thread of the server, for the GIL).", stats.loop_step_cpu_seconds),
            ("loraplex:engine_device_wait_seconds", "Seconds the engine's steps waited for the device: its sampled tokens, and the input copies of the step before.",
             stats.device_wait_seconds),
            ("loraplex:engine_step_sequences",
             "Sequences scheduled, summed over the engine's steps (divided by the steps: the mean batch).",
             stats.step_seqs),
            ("loraplex:engine_prompt_steps",
             "Engine steps that carried prompt chunks (more tokens than sequences: run without a decode CUDA graph).",
             stats.prompt_steps),
            ("loraplex:engine_piecewise_graph_steps",
             "Engine steps (prefill or mixed) that replayed CUDA graphs captured piecewise around attention; the "
             "other prompt steps ran eagerly.", stats.piecewise_graph_steps),
            ("loraplex:engine_loop_dispatch_seconds",
             "Seconds the engine loop spent handing its steps' token deltas to the request handlers (in a process of "
             "its own: sending them to the server).",
             stats.loop_dispatch_seconds),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(model, float(value))
            yield c
        depth = GaugeMetricFamily("loraplex:lora_load_queue_depth", "Adapter reads queued or running.", labels=labels)
        depth.add_metric(model, float(stats.lora_load_queue_depth))
        yield depth
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "LoRA adapters of running and waiting requests (value: scrape time).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache as configured (value 1).",
            labels=["block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"],
        )
        cache.add_metric([str(stats.block_size), stats.kv_cache_dtype, str(stats.num_kv_blocks),
                          str(stats.enable_prefix_caching)], 1.0)
        yield cache
        # as in vLLM: the adapters requests are using now, not the ones merely resident in GPU slots
        info.add_metric([str(self._max_loras), ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)],
                        time.time())
        yield info


class _AdmissionCollector(Collector):
    """Inference requests admitted and not yet accounted: a request leaves only after its usage record is in
    the sink, so 0 means every usage event of the requests so far has been recorded."""

    def __init__(self, in_flight: Callable[[], int], limit: int):
        self._in_flight, self._limit = in_flight, limit

    def collect(self):
        g = GaugeMetricFamily("loraplex:requests_in_flight",
                              "Inference requests admitted and not yet accounted (usage recorded).")
        g.add_metric([], float(self._in_flight()))
        yield g
        cap = GaugeMetricFamily("loraplex:max_concurrent_requests", "Admission cap (beyond it, a fast 503).")
        cap.add_metric([], float(self._limit))
        yield cap


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", ["model_name"], registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", ["model_name"], registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", ["model_name"],
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", ["model_name"], buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.tenant_requests = Counter(
            "loraplex_tenant_requests", "Inference requests per tenant by outcome.", ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "loraplex_tenant_tokens", "Tokens per tenant (kind: prompt, cached, completion).", ["tenant", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "loraplex_rejected_requests", "Requests refused before the engine.", ["reason"], registry=r
        )

    def attach_engine(self, model_name: Callable[[], str], stats: Callable[[], EngineStats | None],
                      max_loras: int) -> None:
        self.registry.register(_EngineCollector(model_name, stats, max_loras))

    def attach_admission(self, in_flight: Callable[[], int], limit: int) -> None:
        self.registry.register(_AdmissionCollector(in_flight, limit))

    def render(self) -> bytes:
        return generate_latest(self.registry)
