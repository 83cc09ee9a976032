"""Helpers for tests of projects that use durable: factory-boy factories and a poller.

Needs ``factory-boy`` (a test dependency, not a runtime one).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import factory

from durable import models
from durable.status import RunStatus

T = TypeVar("T")


class WorkflowRunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.WorkflowRun

    run_id = factory.LazyFunction(lambda: uuid.uuid4().hex)
    workflow = "test.workflow"
    version = "1"
    status = RunStatus.PENDING
    input = factory.LazyFunction(dict)


class RunTagFactory(factory.django.DjangoModelFactory):
    """A tag whose ``status`` mirrors its run's, as the engine keeps it."""

    class Meta:
        model = models.RunTag

    run = factory.SubFactory(WorkflowRunFactory)
    tag = factory.Sequence(lambda n: f"concurrency:key-{n}")
    status = factory.LazyAttribute(lambda o: o.run.status)
    namespace = factory.LazyAttribute(lambda o: o.run.namespace)


class StepRecordFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.StepRecord

    run = factory.SubFactory(WorkflowRunFactory)
    position = factory.Sequence(int)
    name = factory.Sequence(lambda n: f"step-{n}")
    outcome = models.StepRecord.Outcome.COMPLETED
    output = None


def wait_for(predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy; raise ``AssertionError`` at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def tagged(run: Any, *tags: str) -> None:
    """Give a factory-made run its tags (status mirrored)."""
    for tag in tags:
        RunTagFactory(run=run, tag=tag)
