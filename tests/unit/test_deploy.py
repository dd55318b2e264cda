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


def service_monitor() -> dict:
    (monitor,) = yaml.safe_load_all((K8S / "monitoring" / "servicemonitor.yaml").read_text())
    return monitor


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
    # no annotation scrape (it cannot send the metrics token): the ServiceMonitor scrapes the Service's http port
    assert not any(k.startswith("prometheus.io/")
                   for k in one("Deployment")["spec"]["template"]["metadata"].get("annotations", {}))
    (endpoint,) = service_monitor()["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in [p["name"] for p in one("Service")["spec"]["ports"]]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # 503 while loading or draining
    assert c["readinessProbe"].get("timeoutSeconds", 1) > DB_PROBE_TIMEOUT_S  # /ready pings the database
    for dockerfile in DEPLOY.glob("Dockerfile*"):
        assert f"EXPOSE {Settings().port}" in dockerfile.read_text()
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["loraplex"]
    assert f"127.0.0.1:{Settings().port}/ready" in " ".join(compose["healthcheck"]["test"])
    assert compose["ports"] == [f"{Settings().port}:{Settings().port}"]


def shutdown_after_drain_s() -> float:
    """Worst case, from the drain timeout to the process's exit: what still runs is ended (DRAIN_GRACE_S), background
    work finishes, the usage sink drains into the ledger, the engine process stops (then SIGKILL and a 5 s join)."""
    import inspect

    from loraplex.engine.engine_process import ProcessEngine
    from loraplex.platform.cli_serve import DRAIN_GRACE_S
    from loraplex.platform.services import Services
    from loraplex.platform.usage.sink import LedgerSink

    def timeout_s(method) -> float:
        return inspect.signature(method).parameters["timeout_s"].default

    return DRAIN_GRACE_S + timeout_s(Services.wait_background) + timeout_s(LedgerSink.stop) + \
        timeout_s(ProcessEngine.close) + 5


def test_grace_period_covers_prestop_drain_and_shutdown():
    """A SIGKILL before the process exits loses the last usage records to the spool and cuts the engine's stop."""
    spec = one("Deployment")["spec"]["template"]["spec"]
    drain = float(config_env().get("LORAPLEX_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    pre_stop = sum(int(x) for x in container()["lifecycle"]["preStop"]["exec"]["command"] if x.isdigit())
    margin = 10
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + shutdown_after_drain_s() + margin
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grace = compose["services"]["loraplex"]["stop_grace_period"]
    compose_drain = float(compose["services"]["loraplex"]["environment"].get("LORAPLEX_DRAIN_TIMEOUT_S",
                                                                            Settings().drain_timeout_s))
    assert int(grace.rstrip("s")) >= compose_drain + shutdown_after_drain_s() + margin


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


def pod_specs() -> dict[str, dict]:
    """Every pod template of the kustomization, by the name of its workload."""
    out = {}
    for o in k8s_objects():
        if o["kind"] in ("Deployment", "Job"):
            out[o["metadata"]["name"]] = o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            out[o["metadata"]["name"]] = o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return out


def test_every_pod_is_locked_down_and_sized():
    specs = pod_specs()
    assert {"loraplex", "loraplex-db-upgrade"} <= set(specs)
    for name, spec in specs.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken") is False, name  # the server never calls the k8s API
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], name


def test_migrations_run_at_start_and_the_optional_step_survives_reapplies():
    """serve migrates under an advisory lock, so no Job has to run first; the optional step is a suspended CronJob
    used as a template (kubectl create job --from=cronjob/...): a fixed-name Job in the kustomization failed every
    apply with a new image (a Job's pod template is immutable) and lingered forever without a TTL."""
    import inspect

    from loraplex.platform.app import create_app

    assert inspect.signature(create_app).parameters["run_migrations"].default is True
    assert not [o for o in k8s_objects() if o["kind"] == "Job"]
    cron = one("CronJob", "loraplex-db-upgrade")
    assert cron["spec"]["suspend"] is True
    job = cron["spec"]["jobTemplate"]["spec"]
    assert 0 < job["ttlSecondsAfterFinished"] <= 7 * 86400
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["activeDeadlineSeconds"] > 0
    assert job["template"]["spec"]["containers"][0]["args"] == ["db", "upgrade"]


def test_the_image_is_chosen_once_and_never_latest():
    kustomization = one("Kustomization")
    [image] = kustomization["images"]
    tag = image.get("digest") or image.get("newTag")
    assert tag and tag != "latest", image
    for name, spec in pod_specs().items():
        for c in spec["containers"]:
            assert c["image"] == image["name"], (name, c["image"])  # untagged: kustomize sets it


def test_kustomize_renders_the_pinned_image_and_no_secret():
    import shutil
    import subprocess

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the rendered kustomization is not checked")
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    assert "Secret" not in {o["kind"] for o in objects}
    [image] = one("Kustomization")["images"]
    images = set(re.findall(r"^\s*image: (\S+)$", rendered, re.MULTILINE))
    assert images == {f"{image['newName']}:{image['newTag']}"}, images


def test_replicas_spread_over_nodes():
    spec = one("Deployment")["spec"]["template"]["spec"]
    selector = one("Deployment")["spec"]["selector"]["matchLabels"]
    spreads = {t["topologyKey"]: t for t in spec["topologySpreadConstraints"]}
    assert spreads["kubernetes.io/hostname"]["labelSelector"]["matchLabels"] == selector
    assert spreads["kubernetes.io/hostname"]["maxSkew"] == 1


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!")
        regex = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_the_build_context_to_what_the_images_copy():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".venv/bin/python", ".git/HEAD", ".whl/redis-8.2.0-py3-none-any.whl", "docs/benchmarks/x.md",
                 "loraplex/__pycache__/cli.cpython-311.pyc", "loraplex/platform/kv.pyc", "gpu-out/report.json",
                 ".pytest_cache/v/x", ".hypothesis/examples/x", "tests/unit/test_deploy.py", "deploy/.env",
                 "loraplex.egg-info/PKG-INFO"):
        assert dockerignored(path, patterns), path
    copied = {src for dockerfile in DEPLOY.glob("Dockerfile*")
              for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]}
    assert copied == {"pyproject.toml", "README.md", "loraplex", "migrations"}, copied
    for path in ("pyproject.toml", "README.md", "loraplex/cli.py", "loraplex/data/README", "migrations/env.py",
                 "migrations/versions/0001_core.py"):
        assert not dockerignored(path, patterns), path


def test_metrics_port_is_open_to_the_ingress_and_monitoring_only_and_scrapes_send_the_token():
    """/metrics shares the API's port: the NetworkPolicy keeps that port to the ingress controller, Prometheus and
    namespaces marked as API callers, and the ServiceMonitor sends the token the server demands (from the Secret the
    pods read, under the setting's own name), on the Service the pods are behind."""
    policy = one("NetworkPolicy")
    pod_labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [p["name"] for p in container()["ports"]]
    allowed = [peer["namespaceSelector"]["matchLabels"] for peer in rule["from"]]
    assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"])  # whole namespaces, named one by one
    assert {"kubernetes.io/metadata.name": "ingress-nginx"} in allowed
    assert {"kubernetes.io/metadata.name": "monitoring"} in allowed
    assert {} not in allowed  # an empty selector would be every namespace

    monitor = service_monitor()
    assert monitor["metadata"]["namespace"] == one("Deployment")["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one("Service")["metadata"]["labels"].items()
    credentials = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials["name"] in [e["secretRef"]["name"] for e in container()["envFrom"] if "secretRef" in e]
    assert credentials["key"] == "LORAPLEX_METRICS_TOKEN" and credentials["key"] in SECRET_VARIABLES
    assert credentials["key"] in one("Secret")["stringData"]  # the example Secret lists the key to create
    readme = (DEPLOY / "README.md").read_text()
    assert "--from-literal=LORAPLEX_METRICS_TOKEN=" in readme and "servicemonitor.yaml" in readme
