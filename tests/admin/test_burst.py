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
    assert "guaranteed 2 / 2 · borrowed 3 / 4 · pool" in acme
    assert ">global</a> 3 / 5" in acme
    assert "guaranteed 1 / 2 · borrowed 0 / 4" in row(content, "tenant:globex")
    assert content.count(">a pool<") == 1  # the row of key global
    page = admin_client.get(quota_url("tenant:acme")).content.decode()
    assert "guaranteed 2 / 2 · borrowed 3 / 4" in page


def test_a_key_without_burst_shows_none(admin_client: Client) -> None:
    engine = Engine(DjangoStore(), dispatch=inline_dispatch, registry=Registry())
    engine.register("plain", "1", lambda ctx, input: None, concurrency=Concurrency(key="plain", limit=3))
    engine.start("plain", {})
    assert '<td class="field-borrowing">—</td>' in row(admin_client.get(QUOTAS_URL).content.decode(), "plain")
