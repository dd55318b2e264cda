"""A server whose secret settings still hold a placeholder of the deploy files refuses to start, naming the variable:
LORAPLEX_SERVER_SECRET=CHANGE_ME_64_RANDOM_BYTES (deploy/k8s's example Secret) or compose's old
change-me-to-a-long-random-string used to key every tenant's cache salt and the console's sessions on a string anyone
can read in this repository."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest
import yaml

from loraplex.platform.app import create_app
from loraplex.settings import ENV_PREFIX, SECRET_SETTINGS, ConfigError, Settings
from tests.conftest import ROOT

SECRET_VARIABLES = {ENV_PREFIX + name.upper() for name in SECRET_SETTINGS}


def deploy_placeholders() -> list[tuple[str, str]]:
    """(variable, value) of every secret the deploy files write as an example."""
    example = yaml.safe_load((ROOT / "deploy" / "k8s" / "secret.example.yaml").read_text())
    found = [(k, v) for k, v in example["stringData"].items() if k in SECRET_VARIABLES and "CHANGE_ME" in v]
    assert {k for k, _ in found} >= {"LORAPLEX_SERVER_SECRET", "LORAPLEX_DATABASE_URL"}
    return found


@pytest.mark.parametrize("variable, value", deploy_placeholders() + [
    ("LORAPLEX_SERVER_SECRET", "change-me-to-a-long-random-string"),  # deploy/compose.yaml's, before
    ("LORAPLEX_METRICS_TOKEN", "change-me-to-another-long-random-string"),
    ("LORAPLEX_SERVER_SECRET", "changeme"),
    ("LORAPLEX_REDIS_URL", "redis://:Change_Me@redis:6379/0"),
])
def test_a_placeholder_secret_stops_the_server_naming_the_variable(variable, value, tmp_path):
    settings = Settings.from_env({variable: value, "LORAPLEX_DATA_DIR": str(tmp_path)})
    with pytest.raises(ConfigError, match=rf"^{variable} \(it contains '[^']+'\): a placeholder, not a secret"):
        create_app(settings, start_engine=False)


def test_real_secrets_pass():
    Settings(server_secret=secrets.token_hex(32), metrics_token=secrets.token_urlsafe(24),
             database_url="postgresql+asyncpg://loraplex:Xq7vT2mL9@db:5432/loraplex",
             redis_url="redis://redis:6379/0").check_secrets()


def test_serve_refuses_a_placeholder_before_anything_starts(tmp_path):
    env = {**os.environ, "LORAPLEX_SERVER_SECRET": "CHANGE_ME_64_RANDOM_BYTES"}
    proc = subprocess.run([sys.executable, "-m", "loraplex", "serve", "--port", "0", "--data-dir", str(tmp_path / "d")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: LORAPLEX_SERVER_SECRET (it contains 'CHANGE_ME')"), lines
    assert "openssl rand" in lines[0]
    assert "Bootstrap admin key" not in proc.stdout
