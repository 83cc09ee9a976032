"""A queued run replaced by a newer one (CANCEL_QUEUED_EXCEPT_NEWEST), and a start
created cancelled on a full queue (_OLDEST), say why in GET runs/<run_id>/."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

import tests.workflows  # noqa: F401  (registers test.noop)
from durable import Concurrency, Engine, Strategy
from durable.concurrency import replaced_error
from tests.api.helpers import run_url

pytestmark = pytest.mark.django_db


def _starts(strategy: Strategy, n: int) -> list[Any]:
    engine = Engine(dispatch=lambda engine, run: None)  # nothing executes: the first run keeps the slot
    quota = Concurrency(key="preview:7", limit=1, strategy=strategy)
    return [engine.start("test.noop", {"n": i}, concurrency=quota) for i in range(n)]


def test_run_detail_names_the_run_that_replaced_it(api: APIClient) -> None:
    _, replaced, newest = _starts(Strategy.CANCEL_QUEUED_EXCEPT_NEWEST, 3)
    body = api.get(run_url(replaced.run_id)).json()
    assert body["status"] == "cancelled" and body["finished_at"] is not None
    assert body["error"] == replaced_error("preview:7", newest.run_id)
    assert body["error"]["replaced_by"] == newest.run_id
    assert api.get(run_url(newest.run_id)).json()["status"] == "queued"


def test_run_detail_of_a_start_cancelled_on_a_full_queue(api: APIClient) -> None:
    _, kept, late = _starts(Strategy.CANCEL_QUEUED_EXCEPT_OLDEST, 3)
    body = api.get(run_url(late.run_id)).json()
    assert body["status"] == "cancelled"
    assert body["error"]["type"] == "durable.cancel_queued_except_oldest"
    assert body["error"]["key"] == "preview:7"
    assert "the queue of concurrency key preview:7 was full" in body["error"]["message"]
    assert api.get(run_url(kept.run_id)).json()["status"] == "queued"
