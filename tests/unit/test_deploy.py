"""deploy/ agrees with the code: every LORAPLEX_* variable is a setting, ports and probes are the app's,
the grace period covers the drain, the dashboard queries only metrics the server exports, replicas share
the data dir, and /metrics does not leave the cluster."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest
import yaml

from loraplex.engine.protocol import EngineStats
from loraplex.platform.metrics import Metrics
from loraplex.platform.system_routes import DB_PROBE_TIMEOUT_S
from loraplex.platform.system_routes import route_handlers as system_handlers
from loraplex.settings import ENV_PREFIX, OTHER_VARIABLES, SECRET_SETTINGS, ConfigError, Settings
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SETTINGS_VARIABLES = {ENV_PREFIX + f.name.upper() for f in fields(Settings)}
SECRET_VARIABLES = {ENV_PREFIX + name.upper() for name in SECRET_SETTINGS}


def k8s_objects() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def one(kind: str, name: str | None = None) -> dict:
    found = [o for o in k8s_objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container() -> dict:
    return one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def config_env() -> dict[str, str]:
    return {**one("ConfigMap")["data"], **one("Secret")["stringData"]}


def test_manifests_parse_and_kustomization_lists_them_all():
    listed = set(one("Kustomization")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == {name for name in on_disk if not name.endswith(".example.yaml")}
    yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    json.loads((DEPLOY / "grafana" / "loraplex-dashboard.json").read_text())


def test_apply_never_writes_over_the_real_secret():
    """`kubectl apply -k` of a Secret with CHANGE_ME values overwrote the real secrets at every apply: the Secret is an
    example file outside the kustomization, created once by the operator; its placeholders stop the server."""
    listed = one("Kustomization")["resources"]
    for name in listed:
        assert all(d["kind"] != "Secret" for d in yaml.safe_load_all((K8S / name).read_text()) if d), name
    secret = one("Secret")  # the example: still the names the pods read
    assert secret["metadata"]["name"] in [e["secretRef"]["name"] for e in container()["envFrom"] if "secretRef" in e]
    for variable in SECRET_VARIABLES & set(secret["stringData"]):
        if "CHANGE_ME" in secret["stringData"][variable]:
            with pytest.raises(ConfigError):
                Settings.from_env({variable: secret["stringData"][variable]}).check_secrets()


def test_compose_takes_its_secrets_from_the_environment():
    env = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["loraplex"]["environment"]
    for variable in SECRET_VARIABLES & set(env):
        if variable in ("LORAPLEX_SERVER_SECRET", "LORAPLEX_METRICS_TOKEN"):
            # ${VAR:?message}: compose refuses to start without it, instead of shipping a value
            assert re.fullmatch(rf"\$\{{{variable}:\?[^}}]+\}}", env[variable]), env[variable]
        Settings.from_env({variable: env[variable]}).check_secrets()


def _dockerfile_variables(text: str) -> set[str]:
    return set(re.findall(r"\b(LORAPLEX_[A-Z0-9_]+)=", text))


def test_every_loraplex_variable_in_deploy_is_read_by_the_code():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    used = set(config_env()) | {e["name"] for e in container().get("env", [])}
    for service in compose["services"].values():
        used |= set(service.get("environment") or {})
    for dockerfile in DEPLOY.glob("Dockerfile*"):
        used |= _dockerfile_variables(dockerfile.read_text())
    used = {v for v in used if v.startswith(ENV_PREFIX)}
    assert used, "no LORAPLEX_* variables found: the test reads the wrong files"
    unknown = used - SETTINGS_VARIABLES - OTHER_VARIABLES
    assert not unknown, f"not a field of loraplex/settings.py (a typo is silently ignored): {sorted(unknown)}"
    for name, value in config_env().items():  # each value parses as its setting's type
        if name in SETTINGS_VARIABLES:
            Settings.from_env({name: value})


def test_ports_and_probes_are_the_apps():
    paths = {h.paths.copy().pop() for h in system_handlers()}
    assert {"/health", "/ready", "/metrics"} <= paths
    port = int(config_env()["LORAPLEX_PORT"])
    c = container()
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "http"] == [port]
    annotations = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port and annotations["prometheus.io/path"] == "/metrics"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # 503 while loading or draining
    assert c["readinessProbe"].get("timeoutSeconds", 1) > DB_PROBE_TIMEOUT_S  # /ready pings the database
    for dockerfile in DEPLOY.glob("Dockerfile*"):
        assert f"EXPOSE {Settings().port}" in dockerfile.read_text()
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["loraplex"]
    assert f"127.0.0.1:{Settings().port}/ready" in " ".join(compose["healthcheck"]["test"])
    assert compose["ports"] == [f"{Settings().port}:{Settings().port}"]


def test_grace_period_covers_prestop_and_drain():
    spec = one("Deployment")["spec"]["template"]["spec"]
    drain = float(config_env().get("LORAPLEX_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    pre_stop = sum(int(x) for x in container()["lifecycle"]["preStop"]["exec"]["command"] if x.isdigit())
    # after the drain the engine stops and the last usage events are written: keep a margin
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grace = compose["services"]["loraplex"]["stop_grace_period"]
    assert int(grace.rstrip("s")) >= Settings().drain_timeout_s + 10


def test_replicas_share_a_persistent_data_dir():
    """The adapter store and the usage spool live in the data dir: an emptyDir per pod would make an
    adapter uploaded through one replica unloadable on the others, and lose a deleted pod's spool."""
    deployment = one("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    data_dir = config_env()["LORAPLEX_DATA_DIR"]
    mount = next(m for m in container()["volumeMounts"] if m["mountPath"] == data_dir)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "persistentVolumeClaim" in volume, volume
    claim = one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    if deployment["spec"]["replicas"] > 1:
        assert "ReadWriteMany" in claim["spec"]["accessModes"]


def test_read_only_root_leaves_the_caches_writable():
    """Triton compiles kernels into ~/.triton/cache on first use; on a read-only root that fails."""
    c = container()
    if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
        pytest.skip("root filesystem is writable")
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    cache = env.get("TRITON_CACHE_DIR")
    assert cache and any(cache.startswith(m.rstrip("/") + "/") for m in mounts), (cache, mounts)
    assert "/tmp" in mounts


def _prefix_matches(prefix: str, path: str) -> bool:
    """Kubernetes pathType Prefix: element-wise."""
    p = [x for x in prefix.split("/") if x]
    return p == [x for x in path.split("/") if x][: len(p)]


def test_ingress_routes_the_api_but_not_metrics():
    """The server-snippet annotation is off by default in ingress-nginx; the paths themselves must not
    route /metrics (it names tenants and adapters)."""
    ingress = one("Ingress")
    paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]

    def routed(path: str) -> bool:
        return any(p["path"] == path if p["pathType"] == "Exact" else _prefix_matches(p["path"], path)
                   for p in paths)

    for public in ("/v1/chat/completions", "/v1/adapters", "/admin/tenants", "/console", "/console/usage",
                   "/health", "/ready", "/schema/openapi.json"):
        assert routed(public), public
    assert not routed("/metrics")


def exported_metric_names() -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics()
    metrics.attach_engine(lambda: "base", lambda: EngineStats(), max_loras=8)
    metrics.tenant_requests.labels("t", "completed").inc()
    metrics.tenant_tokens.labels("t", "prompt").inc()
    metrics.rejected.labels("rate_limit").inc()
    metrics.ttft.labels("base").observe(0.1)
    metrics.itl.labels("base").observe(0.1)
    metrics.e2e.labels("base").observe(0.1)
    metrics.prompt_tokens.labels("base").inc()
    metrics.generation_tokens.labels("base").inc()
    metrics.request_success.labels("base", "stop").inc()
    text = metrics.render().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_queries_only_exported_metrics():
    exported = exported_metric_names()
    dashboard = json.loads((DEPLOY / "grafana" / "loraplex-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm|loraplex)[a-zA-Z0-9_:]*)", e)}
    assert used and not used - exported, sorted(used - exported)


def test_gpu_image_has_a_c_compiler_for_triton():
    """Triton compiles a C launcher at first use; without gcc every kernel fails 'Failed to find C compiler'."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"apt-get install[^\n]*\bgcc\b", text)
