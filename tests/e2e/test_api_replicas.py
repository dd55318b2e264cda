"""Two replicas on one PostgreSQL + Redis: revocation and suspension reach the other replica within a
second, and a tenant's rate limit is one bucket across replicas."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.server import backend_server, start_server


@pytest.fixture(scope="module")
def replicas(request, tmp_path_factory):
    env = {"LORAPLEX_NUM_KV_BLOCKS": "256", "LORAPLEX_LOG_LEVEL": "WARNING"}
    with backend_server(request, tmp_path_factory, "postgres_redis", env=env) as a:
        # same database, Redis and server secret; the bootstrap key was printed by replica A
        b = start_server(tmp_path_factory.mktemp("replica-b"), model=a.env["LORAPLEX_MODEL"],
                         database_url=a.env["LORAPLEX_DATABASE_URL"], redis_url=a.env["LORAPLEX_REDIS_URL"],
                         env={**env, "LORAPLEX_SERVER_SECRET": a.env["LORAPLEX_SERVER_SECRET"]},
                         admin_key=a.admin_key)
        try:
            yield a, b
        finally:
            assert b.stop() == 0


def _rejected_within(client: openai.OpenAI, seconds: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < seconds, f"still accepted {seconds}s later"
        time.sleep(0.02)


def test_revocation_on_one_replica_reaches_the_other(replicas):
    a, b = replicas
    t = a.create_tenant("revokee")
    on_b = openai.OpenAI(api_key=t["key"], base_url=b.base_url + "/v1", max_retries=0)
    on_b.models.list()  # B has the key in its auth cache
    with a.client() as admin:
        assert admin.delete(f"/admin/keys/{t['key_id']}").status_code == 200
    _rejected_within(on_b, 1.0)


def test_suspension_on_one_replica_reaches_the_other(replicas):
    a, b = replicas
    t = b.create_tenant("suspendee")
    on_a = openai.OpenAI(api_key=t["key"], base_url=a.base_url + "/v1", max_retries=0)
    on_a.models.list()
    with b.client() as admin:
        assert admin.post("/admin/tenants/suspendee/suspend").status_code == 200
    _rejected_within(on_a, 1.0)


def test_rate_limit_is_shared_across_replicas(replicas):
    a, b = replicas
    t = a.create_tenant("shared-limit", requests_per_minute=3)
    clients = [openai.OpenAI(api_key=t["key"], base_url=s.base_url + "/v1", max_retries=0) for s in (a, b)]
    model = clients[0].models.list().data[0].id
    for i in range(3):
        clients[i % 2].completions.create(model=model, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        clients[1].completions.create(model=model, prompt="x", max_tokens=1)
    assert err.value.response.headers["x-ratelimit-remaining-requests"] == "0"
