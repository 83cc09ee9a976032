"""The quota dashboard of keys with a burst: guaranteed, borrowed and the pool's use."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from durable import Burst, Concurrency, DjangoStore, Engine
from durable.runtime import Registry, inline_dispatch
from tests.admin.helpers import QUOTAS_URL, quota_url, row

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine(settings: Any) -> Engine:
    settings.DURABLE = {**settings.DURABLE, "POOLS": {"global": 5}}
    engine = Engine(DjangoStore(), dispatch=lambda engine, run: None, registry=Registry())
    tenant = Concurrency(key=lambda input: f"tenant:{input['t']}", limit=2, burst=Burst(pool="global", up_to=6))
    engine.register("w", "1", lambda ctx, input: None, concurrency=tenant)
    return engine


def test_a_key_with_a_burst_shows_guaranteed_borrowed_and_its_pool(admin_client: Client, engine: Engine) -> None:
    for _ in range(5):
        engine.start("w", {"t": "acme"})  # 2 guaranteed, 3 borrowed
    engine.start("w", {"t": "globex"})
    content = admin_client.get(QUOTAS_URL).content.decode()
    acme = row(content, "tenant:acme")
    assert "2 + 3 borrowed" in acme and 'title="guaranteed 2 of 2, borrowed 3 of 4"' in acme
    assert ">global</a> 3 / 5" in acme
    # Its use reads against its ceiling (2 + 4 borrowable); the pool has room: not full.
    assert "5 / 2 + 4" in acme and "FULL" not in acme
    assert "1 + 0 borrowed" in row(content, "tenant:globex")
    assert content.count(">a pool<") == 1  # the row of key global
    page = admin_client.get(quota_url("tenant:acme")).content.decode()
    assert "guaranteed 2 of 2 · borrowed 3 of 4 (up to 6 in all)" in page


def test_a_key_beyond_its_limit_is_full_when_its_pool_is(admin_client: Client, engine: Engine) -> None:
    for _ in range(3):
        engine.start("w", {"t": "acme"})  # 2 guaranteed, 1 borrowed
    for _ in range(6):
        engine.start("w", {"t": "globex"})  # 2 guaranteed, 4 borrowed: the pool's 5 are taken
    engine.start("w", {"t": "initech"})
    content = admin_client.get(QUOTAS_URL).content.decode()
    assert "3 / 2 + 4" in row(content, "tenant:acme") and "FULL" in row(content, "tenant:acme")
    assert "6 / 2 + 4" in row(content, "tenant:globex") and "FULL" in row(content, "tenant:globex")
    # Within its limit a key is never full for its pool: its guaranteed slots are its own.
    assert "1 / 2 + 4" in row(content, "tenant:initech") and "FULL" not in row(content, "tenant:initech")


def test_a_key_without_burst_shows_none(admin_client: Client) -> None:
    engine = Engine(DjangoStore(), dispatch=inline_dispatch, registry=Registry())
    engine.register("plain", "1", lambda ctx, input: None, concurrency=Concurrency(key="plain", limit=3))
    engine.start("plain", {})
    plain = row(admin_client.get(QUOTAS_URL).content.decode(), "plain")
    assert "1 / 3" in plain and "borrowed" not in plain and "pool" not in plain
    page = admin_client.get(quota_url("plain")).content.decode()
    assert "—" in page.split("field-borrowing")[1][:400]
