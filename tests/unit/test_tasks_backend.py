"""``durable.contrib.tasks.DurableBackend`` without a worker: a run is executed
here with ``engine.execute`` (what a Celery worker calls). SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.urls import path
from django.utils import timezone
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from durable import Concurrency, ConcurrencyLimitError, RunStatus, engine, models
from durable.contrib.tasks import WORKFLOW, DurableBackend, DurableTask
from durable.contrib.tasks import framework as fw
from tests import djtasks

Status = fw.TaskResultStatus


def _tasks(settings: Any, **options: Any) -> DurableBackend:
    """TASKS with one DurableBackend (``options`` its OPTIONS); the framework drops its
    cached backends when TASKS changes."""
    settings.TASKS = {
        "default": {"BACKEND": "durable.contrib.tasks.DurableBackend", "QUEUES": ["default", "emails"], "OPTIONS": options}
    }
    backend = fw.task_backends["default"]
    assert isinstance(backend, DurableBackend)
    return backend


def _limited(task: Any, concurrency: Any) -> Any:
    """``task`` as a DurableTask carrying its own quota (what ``@task(concurrency=...)`` builds)."""
    return DurableTask(
        func=task.func,
        priority=task.priority,
        backend=task.backend,
        queue_name=task.queue_name,
        run_after=task.run_after,
        takes_context=task.takes_context,
        concurrency=concurrency,
    )


def test_capabilities_are_stated() -> None:
    assert DurableBackend.supports_defer is True
    assert DurableBackend.supports_async_task is True
    assert DurableBackend.supports_get_result is True
    assert DurableBackend.supports_priority is False  # runs execute in delivery order


@pytest.mark.django_db
def test_enqueue_creates_a_ready_run_of_the_task_workflow() -> None:
    result = djtasks.add.enqueue(2, b=3)

    assert result.status == Status.READY
    assert (result.args, result.kwargs, result.backend) == ([2], {"b": 3}, "default")
    assert result.task == djtasks.add
    assert result.enqueued_at is not None and result.started_at is None and result.finished_at is None
    run = engine.get_run(result.id)
    assert (run.workflow, run.status, run.record.queue) == (WORKFLOW, RunStatus.PENDING, "")
    assert run.input == {
        "task": "tests.djtasks.add",
        "args": [2],
        "kwargs": {"b": 3},
        "backend": "default",
        "queue_name": "default",
        "run_after": None,
        "takes_context": False,
    }
    with pytest.raises(ValueError, match="not finished"):
        result.return_value  # noqa: B018


@pytest.mark.django_db
def test_the_run_executes_the_task_and_the_result_follows() -> None:
    result = djtasks.add.enqueue(2, 3)
    engine.execute(result.id)

    assert result.status == Status.READY  # as of enqueue until refreshed
    result.refresh()
    assert result.status == Status.SUCCESSFUL
    assert result.return_value == 5
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert len(result.worker_ids) == 1 and result.attempts == 1
    fetched = djtasks.add.get_result(result.id)
    assert (fetched.status, fetched.return_value, fetched.finished_at) == (Status.SUCCESSFUL, 5, result.finished_at)
    steps = list(models.StepRecord.objects.filter(run__run_id=result.id).values_list("name", "outcome"))
    assert steps == [("tests.djtasks.add", "completed")]  # one journaled step, named after the task


@pytest.mark.django_db
def test_an_async_task_function_runs() -> None:
    result = djtasks.async_add.enqueue(20, 22)
    engine.execute(result.id)
    result.refresh()
    assert (result.status, result.return_value) == (Status.SUCCESSFUL, 42)


@pytest.mark.django_db
def test_a_failing_task_is_failed_with_its_exception_and_traceback() -> None:
    result = djtasks.fail.enqueue("out of paper")
    engine.execute(result.id)
    result.refresh()

    assert result.status == Status.FAILED
    assert result.finished_at is not None
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "raise ValueError(message)" in error.traceback and "out of paper" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018


@pytest.mark.django_db
def test_a_cancelled_run_is_failed_without_an_exception_of_the_task() -> None:
    result = djtasks.add.enqueue(1, 1)
    engine.cancel(result.id)
    result.refresh()
    assert result.status == Status.FAILED
    assert result.errors[0].exception_class_path == "durable.exceptions.RunFailedError"
    assert result.started_at is None and result.worker_ids == []


@pytest.mark.django_db
def test_a_task_that_takes_a_context_gets_its_result() -> None:
    result = djtasks.whoami.enqueue()
    engine.execute(result.id)
    result.refresh()
    assert result.return_value == {"id": result.id, "attempt": 1}


@pytest.mark.django_db
def test_status_transitions(settings: Any) -> None:
    result = djtasks.add.enqueue(1, 2)
    assert djtasks.add.get_result(result.id).status == Status.READY
    # Running: claimed by a worker (what the executor does first), not finished.
    models.WorkflowRun.objects.filter(run_id=result.id).update(status=RunStatus.RUNNING, started_at=timezone.now(), worker="w1")
    running = djtasks.add.get_result(result.id)
    assert running.status == Status.RUNNING
    assert running.started_at is not None and running.worker_ids == ["w1"]
    for status, expected in [
        (RunStatus.QUEUED, Status.READY),
        (RunStatus.SUSPENDED, Status.READY),
        (RunStatus.BLOCKED, Status.READY),
        (RunStatus.DEAD, Status.FAILED),
    ]:
        models.WorkflowRun.objects.filter(run_id=result.id).update(status=status)
        assert djtasks.add.get_result(result.id).status == expected, status


@pytest.mark.django_db
def test_get_result_of_an_unknown_id_raises_the_frameworks_error() -> None:
    with pytest.raises(fw.TaskResultDoesNotExist):
        fw.task_backends["default"].get_result("no-such-run")
    other = engine.start("test.add", {"a": 1, "b": 2})  # a run, but not a task's
    with pytest.raises(fw.TaskResultDoesNotExist):
        fw.task_backends["default"].get_result(other.run_id)


@pytest.mark.django_db
def test_get_result_of_another_task_is_a_mismatch() -> None:
    result = djtasks.add.enqueue(1, 2)
    with pytest.raises(fw.TaskResultMismatch):
        djtasks.fail.get_result(result.id)


QUIET = "tests.djtasks.quiet_engine"  # for the tests that commit: no Celery message, no session worker racing them


@pytest.mark.django_db(transaction=True)
def test_aenqueue_and_aget_result(settings: Any) -> None:
    _tasks(settings, ENGINE=QUIET)

    async def flow() -> tuple[Any, Any]:
        result = await djtasks.async_add.aenqueue(1, 2)
        fetched = await djtasks.async_add.aget_result(result.id)
        return result, fetched

    result, fetched = async_to_sync(flow)()
    assert result.status == Status.READY and fetched.id == result.id
    djtasks.quiet_engine.execute(result.id)
    async_to_sync(result.arefresh)()
    assert (result.status, result.return_value) == (Status.SUCCESSFUL, 3)


@pytest.mark.django_db
def test_arguments_that_are_not_json_are_refused_and_create_nothing() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):  # the framework's own message
        djtasks.add.enqueue(datetime.now(), 1)
    with pytest.raises(ValueError, match="must be a JSON value"):  # durable's stricter check
        djtasks.add.enqueue(float("nan"), 1)
    with pytest.raises(ValueError, match="NUL"):
        djtasks.add.enqueue("a\x00b", 1)
    assert models.WorkflowRun.objects.count() == 0


@pytest.mark.django_db
def test_priority_and_unknown_queues_are_refused() -> None:
    with pytest.raises(fw.InvalidTaskError, match="priority"):
        djtasks.add.using(priority=10)
    with pytest.raises(fw.InvalidTaskError, match="Queue 'bulk'"):
        djtasks.add.using(queue_name="bulk")
    assert models.WorkflowRun.objects.count() == 0


@pytest.mark.django_db
def test_queue_name_is_the_runs_celery_queue() -> None:
    result = djtasks.send_email.enqueue("ada@example.com")
    assert engine.get_run(result.id).record.queue == "emails"
    assert engine.get_run(djtasks.add.using(queue_name="emails").enqueue(1, 2).id).record.queue == "emails"


@pytest.mark.django_db
def test_run_after_parks_the_run_until_then(settings: Any) -> None:
    due = timezone.now() + timedelta(hours=1)
    result = djtasks.add.using(run_after=due).enqueue(1, 2)
    assert result.task.run_after == due
    engine.execute(result.id)  # parks at once: a durable sleep until run_after

    run = engine.get_run(result.id)
    assert (run.status, run.record.wake_at) == (RunStatus.SUSPENDED, due)
    parked = djtasks.add.get_result(result.id)
    assert (parked.status, parked.started_at) == (Status.READY, None)
    assert parked.task.run_after == due
    assert not models.StepRecord.objects.filter(run__run_id=result.id, name="tests.djtasks.add").exists()


@pytest.mark.django_db
def test_a_naive_run_after_is_refused() -> None:
    with pytest.raises(fw.InvalidTaskError, match="aware"):
        djtasks.add.using(run_after=datetime.now())


# -- quotas --------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_task_quota_from_options_refuses_at_enqueue_and_creates_nothing(settings: Any) -> None:
    _tasks(settings, CONCURRENCY={"tests.djtasks.add": {"expression": "'adders'", "limit": 2}})
    first, second = djtasks.add.enqueue(1, 1), djtasks.add.enqueue(1, 2)
    before = models.WorkflowRun.objects.count()

    with pytest.raises(ConcurrencyLimitError) as refused:
        djtasks.add.enqueue(1, 3)
    assert (refused.value.key, refused.value.limit, refused.value.active) == ("adders", 2, 2)
    assert refused.value.workflow == WORKFLOW
    assert models.WorkflowRun.objects.count() == before
    assert djtasks.fail.enqueue("other task: no quota").status == Status.READY

    engine.execute(first.id)  # a finished run frees its slot
    assert djtasks.add.enqueue(1, 4).status == Status.READY
    assert second.id != first.id


@pytest.mark.django_db
def test_a_quota_key_reads_the_tasks_arguments(settings: Any) -> None:
    _tasks(settings, CONCURRENCY={"tests.djtasks.send_email": Concurrency(expression="'mail:' + input.args[0]", limit=1)})
    djtasks.send_email.enqueue("ada@example.com")
    djtasks.send_email.enqueue("bob@example.com")  # another key
    with pytest.raises(ConcurrencyLimitError) as refused:
        djtasks.send_email.enqueue("ada@example.com")
    assert refused.value.key == "mail:ada@example.com"


@pytest.mark.django_db
def test_a_queue_quota_covers_every_task_of_the_queue(settings: Any) -> None:
    _tasks(settings, CONCURRENCY={"queue:emails": {"key": "emails", "limit": 1}})
    djtasks.send_email.enqueue("ada@example.com")
    with pytest.raises(ConcurrencyLimitError):
        djtasks.add.using(queue_name="emails").enqueue(1, 2)
    assert djtasks.add.enqueue(1, 2).status == Status.READY  # the default queue has no quota


@pytest.mark.django_db
def test_a_task_may_carry_its_own_quota(settings: Any) -> None:
    limited = _limited(djtasks.add, Concurrency(key="own", limit=1))
    assert dataclasses.replace(limited).concurrency == limited.concurrency
    limited.enqueue(1, 2)
    with pytest.raises(ConcurrencyLimitError) as refused:
        limited.using(queue_name="emails").enqueue(3, 4)  # using() keeps the quota
    assert refused.value.key == "own"


def _decorator() -> Any:
    if fw.NAME == "django.tasks":
        from django.tasks import task
    else:
        from django_tasks import task
    return task


#: Whether ``@task`` passes extra arguments to the backend's task class (the backport, Django 6.1).
TASK_KWARGS = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(_decorator()).parameters.values())


@pytest.mark.skipif(not TASK_KWARGS, reason="this @task takes no extra arguments (Django 6.0): the quota goes in OPTIONS")
@pytest.mark.django_db
def test_the_task_decorator_takes_a_quota() -> None:
    limited = _decorator()(concurrency=Concurrency(key="decorated", limit=1))(djtasks.add.func)
    assert isinstance(limited, DurableTask)
    limited.enqueue(1, 2)
    with pytest.raises(ConcurrencyLimitError):
        limited.enqueue(1, 2)


class EnqueueView(APIView):
    permission_classes = [AllowAny]

    def post(self, request: Request) -> Response:
        result = djtasks.send_email.enqueue(request.data["to"])
        return Response({"id": result.id}, status=202)


urlpatterns = [path("send/", EnqueueView.as_view())]


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_a_full_quota_is_429_through_the_drf_handler(settings: Any) -> None:
    _tasks(settings, CONCURRENCY={"tests.djtasks.send_email": {"expression": "input.args[0]", "limit": 1}})
    client = APIClient()
    assert client.post("/send/", {"to": "ada"}, format="json").status_code == 202
    before = models.WorkflowRun.objects.count()

    response = client.post("/send/", {"to": "ada"}, format="json")

    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1
    body = response.json()
    assert (body["code"], body["workflow"], body["key"], body["limit"], body["active"]) == (
        "concurrency_limit",
        WORKFLOW,
        "ada",
        1,
        1,
    )
    assert models.WorkflowRun.objects.count() == before


# -- configuration -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"PRIORITY": 1}, "unknown options \\['PRIORITY'\\]"),
        ({"CONCURRENCY": ["tests.djtasks.add"]}, "maps task module paths"),
        ({"CONCURRENCY": {"tests.djtasks.add": 3}}, "must be a durable.Concurrency or a dict"),
        ({"CONCURRENCY": {"tests.djtasks.add": {"limit": 3}}}, "exactly one of key"),
        ({"CONCURRENCY": {"tests.djtasks.add": {"key": "k", "limit": 1, "colour": "red"}}}, "colour"),
        ({"CONCURRENCY": {"queue:bulk": {"key": "k", "limit": 1}}}, "not among the backend's QUEUES"),
        ({"ENGINE": 3}, "dotted path of a durable Engine"),
    ],
)
def test_bad_options_are_refused_when_the_backend_is_built(settings: Any, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        _tasks(settings, **options)


def test_an_engine_that_is_not_one_is_refused_on_first_use(settings: Any) -> None:
    backend = _tasks(settings, ENGINE="tests.djtasks.add")
    with pytest.raises(ImproperlyConfigured, match="is not a durable Engine"):
        backend.engine  # noqa: B018


def test_the_backend_passes_its_checks() -> None:
    assert list(fw.task_backends["default"].check()) == []


@pytest.mark.django_db
def test_settings_alone_move_a_task_from_the_immediate_backend(settings: Any) -> None:
    """The how-to's worked example: the same task and call, only TASKS changes."""
    immediate = (
        "django.tasks.backends.immediate.ImmediateBackend"
        if fw.NAME == "django.tasks"
        else ("django_tasks.backends.immediate.ImmediateBackend")
    )
    settings.TASKS = {"default": {"BACKEND": immediate}}
    before = djtasks.add.enqueue(2, 3)
    assert (before.status, before.return_value) == (Status.SUCCESSFUL, 5)  # ran in the call
    assert models.WorkflowRun.objects.count() == 0

    settings.TASKS = {"default": {"BACKEND": "durable.contrib.tasks.DurableBackend"}}
    after = djtasks.add.enqueue(2, 3)
    assert after.status == Status.READY  # a durable run, for a worker
    assert engine.get_run(after.id).workflow == WORKFLOW
    engine.execute(after.id)
    after.refresh()
    assert (after.status, after.return_value) == (Status.SUCCESSFUL, 5)


@pytest.mark.django_db
def test_an_enqueue_in_a_rolled_back_transaction_enqueued_nothing() -> None:

    with pytest.raises(RuntimeError), transaction.atomic():
        result = djtasks.add.enqueue(1, 2)
        assert djtasks.add.get_result(result.id).status == Status.READY  # seen inside the transaction
        raise RuntimeError("rolled back")
    with pytest.raises(fw.TaskResultDoesNotExist):
        djtasks.add.get_result(result.id)


def test_without_a_tasks_framework_the_import_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['django.tasks'] = None; sys.modules['django_tasks'] = None\n"
        "import durable.contrib.tasks.framework\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr
    assert "django-durable-workflows[tasks]" in done.stderr


async def _five(key: str) -> int:
    return 1 if key == "one" else 5


@pytest.mark.django_db(transaction=True)
def test_aenqueue_awaits_an_async_limit_and_refuses_over_it(settings: Any) -> None:
    _tasks(settings, ENGINE=QUIET, CONCURRENCY={"tests.djtasks.async_add": Concurrency(expression="'one'", limit=_five)})

    async def twice() -> Any:
        await djtasks.async_add.aenqueue(1, 2)
        return await djtasks.async_add.aenqueue(1, 2)

    with pytest.raises(ConcurrencyLimitError) as refused:
        async_to_sync(twice)()
    assert (refused.value.key, refused.value.limit) == ("one", 1)
    assert models.WorkflowRun.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_queueing_quota_keeps_the_task_ready_until_a_slot_frees(settings: Any) -> None:
    from durable import Strategy

    quota = Concurrency(key="adders", limit=1, strategy=Strategy.GROUP_ROUND_ROBIN)
    _tasks(settings, ENGINE=QUIET, CONCURRENCY={"tests.djtasks.add": quota})
    first, second = djtasks.add.enqueue(1, 1), djtasks.add.enqueue(2, 2)
    assert engine.get_run(second.id).status == RunStatus.QUEUED
    assert second.status == Status.READY

    djtasks.quiet_engine.execute(first.id)  # its end hands the slot to the queued run
    assert engine.get_run(second.id).status == RunStatus.PENDING
    djtasks.quiet_engine.execute(second.id)
    assert djtasks.add.get_result(second.id).return_value == 4


@pytest.mark.django_db
def test_an_operator_tells_which_task_a_run_is(admin_client: Any) -> None:
    from django.urls import reverse

    result = djtasks.send_email.enqueue("ada@example.com")
    engine.execute(result.id)
    other = engine.start("test.add", {"a": 1, "b": 2})  # not a task
    [run] = [h for h in engine.list_runs(workflow=WORKFLOW) if h.input["task"] == "tests.djtasks.send_email"]
    assert run.run_id == result.id

    pk = models.WorkflowRun.objects.get(run_id=result.id).pk
    page = admin_client.get(reverse("admin:durable_workflowrun_change", args=[pk])).content.decode()
    assert "tests.djtasks.send_email" in page  # its input and its one step name the task
    listing = admin_client.get(reverse("admin:durable_workflowrun_changelist") + "?workflow=durable.task").content.decode()
    assert result.id in listing and other.run_id not in listing


@pytest.mark.django_db
def test_a_deferred_task_holds_its_slot_from_enqueue(settings: Any) -> None:
    _tasks(settings, CONCURRENCY={"tests.djtasks.add": {"key": "adders", "limit": 1}})
    later = djtasks.add.using(run_after=timezone.now() + timedelta(hours=1))
    parked = later.enqueue(1, 2)
    with pytest.raises(ConcurrencyLimitError):  # refused at enqueue: the slot is taken, pending
        djtasks.add.enqueue(3, 4)
    engine.execute(parked.id)
    assert engine.get_run(parked.id).status == RunStatus.SUSPENDED
    with pytest.raises(ConcurrencyLimitError):  # and while it sleeps (suspended counts by default)
        djtasks.add.enqueue(3, 4)


@pytest.mark.django_db
def test_a_deferred_task_sleeps_without_a_slot_when_suspended_is_not_counted(settings: Any) -> None:
    statuses = ["pending", "running", "blocked"]
    _tasks(settings, CONCURRENCY={"tests.djtasks.add": {"key": "adders", "limit": 1, "count_statuses": statuses}})
    parked = djtasks.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 2)
    engine.execute(parked.id)  # parks: its slot is free again
    assert engine.get_run(parked.id).status == RunStatus.SUSPENDED
    assert djtasks.add.enqueue(3, 4).status == Status.READY


@pytest.mark.django_db
def test_a_worker_without_the_runs_backend_alias_still_runs_the_task(caplog: Any) -> None:
    result = djtasks.add.enqueue(20, 1)
    run = models.WorkflowRun.objects.get(run_id=result.id)
    run.input = {**run.input, "backend": "gone"}  # TASKS of the worker lacks the alias it was enqueued on
    run.save(update_fields=["input"])

    engine.execute(result.id)

    handle = engine.get_run(result.id)
    assert (handle.status, handle.output) == (RunStatus.COMPLETED, 21)
    assert "TASKS['gone'] cannot be loaded" in caplog.text  # ran without the framework's signals


@pytest.mark.django_db(transaction=True)  # task_enqueued is sent when the enqueue commits
def test_the_frameworks_signals_follow_the_task(settings: Any) -> None:
    _tasks(settings, ENGINE=QUIET)
    seen: list[tuple[str, str, str]] = []

    def receiver(name: str) -> Any:
        def record(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, task_result.id, str(task_result.status)))

        return record

    receivers = {
        s: receiver(n) for s, n in [(fw.task_enqueued, "enqueued"), (fw.task_started, "started"), (fw.task_finished, "finished")]
    }
    for signal, fn in receivers.items():
        signal.connect(fn)
    try:
        ok = djtasks.add.enqueue(1, 2)
        djtasks.quiet_engine.execute(ok.id)
        failed = djtasks.fail.enqueue("no")
        djtasks.quiet_engine.execute(failed.id)
        with pytest.raises(RuntimeError), transaction.atomic():
            djtasks.add.enqueue(3, 4)
            assert [name for name, *_ in seen].count("enqueued") == 2  # not before the commit
            raise RuntimeError("rolled back: nothing was enqueued")
    finally:
        for signal, fn in receivers.items():
            signal.disconnect(fn)

    assert seen == [
        ("enqueued", ok.id, "READY"),
        ("started", ok.id, "RUNNING"),
        ("finished", ok.id, "SUCCESSFUL"),
        ("enqueued", failed.id, "READY"),
        ("started", failed.id, "RUNNING"),
        ("finished", failed.id, "FAILED"),
    ]
