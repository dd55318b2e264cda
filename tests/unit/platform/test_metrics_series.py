"""/metrics exports each counter and histogram once per label set: no ``*_created`` twin series (prometheus_client's
default), which doubled the series a Prometheus server stores for counters and gave Grafana nothing to plot."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.protocol import EngineStats
from loraplex.platform.metrics import Metrics


def test_counters_and_histograms_export_no_created_series():
    metrics = Metrics()
    metrics.attach_engine(lambda: "base", lambda: EngineStats(), max_loras=4)
    metrics.tenant_requests.labels("acme", "completed").inc()
    metrics.tenant_tokens.labels("acme", "prompt").inc(7)
    metrics.rejected.labels("rate_limit").inc()
    metrics.request_success.labels("base", "stop").inc()
    metrics.ttft.labels("base").observe(0.1)
    samples = {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
    assert samples["loraplex_tenant_tokens_total"] == 7  # the counters themselves are still there
    assert samples["vllm:time_to_first_token_seconds_count"] == 1
    assert not [name for name in samples if name.endswith("_created")]
