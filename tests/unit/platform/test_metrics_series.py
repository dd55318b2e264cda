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


def test_every_rejection_reason_is_documented():
    # an alert on loraplex_rejected_requests_total{reason="quota"} is written from docs/api.md's list of reasons
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    emitted = set()
    for path in (root / "loraplex" / "platform").rglob("*.py"):
        for call in re.findall(r"rejected\.labels\(([^)]*)\)", path.read_text()):
            emitted |= set(re.findall(r'"([a-z_]+)"', call))
    assert {"rate_limit", "admission", "quota"} <= emitted  # the scan works
    doc = (root / "docs" / "api.md").read_text()
    paragraph = doc.split("loraplex_rejected_requests_total{reason}", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"\b([a-z_]+)\b", paragraph))
    assert emitted <= documented, f"reasons missing from docs/api.md: {sorted(emitted - documented)}"
