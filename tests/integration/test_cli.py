"""``manage.py durable``: runs, show, cancel, retry, quotas and purge (SQLite and PostgreSQL)."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from durable import models
from durable.concurrency import TAG_PREFIX
from durable.management.progress import Progress
from durable.status import RunStatus
from durable.testing import RunTagFactory, StepRecordFactory, WorkflowRunFactory, tagged

pytestmark = pytest.mark.django_db


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def durable(*args: str) -> tuple[str, str]:
    """Run ``manage.py durable ARGS`` (stderr a terminal: progress lines are written); return (stdout, stderr)."""
    out, err = io.StringIO(), Terminal()
    call_command("durable", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def finished_run(status: str, age: timedelta, **fields: Any) -> models.WorkflowRun:
    run = WorkflowRunFactory(status=status, finished_at=timezone.now() - age, **fields)
    tagged(run, f"concurrency:k-{run.pk}")
    StepRecordFactory(run=run, position=0)
    models.Signal.objects.create(run=run, name="go")
    return run


def add_run(status: str, key: str, **fields: Any) -> models.WorkflowRun:
    """A run of the registered ``test.add`` workflow (quota: 3 per input["key"])."""
    run = WorkflowRunFactory(workflow="test.add", version="1", status=status, input={"key": key, "a": 1, "b": 2}, **fields)
    tagged(run, TAG_PREFIX + key)
    models.ConcurrencyLock.objects.get_or_create(key=key, defaults={"limit": 3, "count_statuses": ["pending", "running"]})
    return run


# -- runs ------------------------------------------------------------------------------


def test_runs_lists_newest_first_and_filters() -> None:
    old = WorkflowRunFactory(workflow="a.b", status=RunStatus.COMPLETED)
    models.WorkflowRun.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=3))
    running = WorkflowRunFactory(workflow="a.b", status=RunStatus.RUNNING)
    tagged(running, "concurrency:tenant:acme")
    other = WorkflowRunFactory(workflow="c.d", status=RunStatus.FAILED)

    out, _ = durable("runs")
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "WORKFLOW", "STATUS", "NAMESPACE", "CREATED", "FINISHED"]
    assert [line.split()[0] for line in lines[1:]] == [other.run_id, running.run_id, old.run_id]

    def listed(*args: str) -> list[str]:
        return [row["run_id"] for row in json.loads(durable("runs", "--json", *args)[0])]

    assert listed("--status", "running,failed") == [other.run_id, running.run_id]
    assert listed("--status", "completed", "--status", "failed") == [other.run_id, old.run_id]
    assert listed("--workflow", "a.b") == [running.run_id, old.run_id]
    assert listed("--key", "tenant:acme") == [running.run_id]
    assert listed("--tag", "concurrency:tenant:acme") == [running.run_id]
    assert listed("--older-than", "2d") == [old.run_id]
    assert listed("--newer-than", "1h") == [other.run_id, running.run_id]
    assert listed("--limit", "1") == [other.run_id]
    assert "--limit 0 shows all" in durable("runs", "--limit", "2")[0]
    assert durable("runs", "--workflow", "nothing")[0] == "No runs match.\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "runing"], "Unknown status 'runing'"),
        (["--older-than", "30x"], "--older-than: '30x' is not a duration"),
        (["--newer-than", "d"], "is not a duration"),
        (["--limit", "-1"], "--limit must be 0 or more"),
    ],
)
def test_runs_refuses_bad_filters(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        durable("runs", *args)


def test_runs_of_one_namespace() -> None:
    here = WorkflowRunFactory(namespace="blue")
    WorkflowRunFactory(namespace="green")
    rows = json.loads(durable("runs", "--json", "--namespace", "blue")[0])
    assert [row["run_id"] for row in rows] == [here.run_id]


# -- show ------------------------------------------------------------------------------


def test_show_prints_a_run_with_its_tags_and_steps() -> None:
    parent = WorkflowRunFactory(status=RunStatus.SUSPENDED)
    run = WorkflowRunFactory(status=RunStatus.FAILED, parent=parent, input={"n": 1}, error={"message": "boom"})
    tagged(run, "concurrency:tenant:acme", "team:red")
    StepRecordFactory(run=run, position=0, name="load", output={"rows": 2})
    StepRecordFactory(run=run, position=1, name="send", outcome="failed", error={"message": "boom"})

    out, _ = durable("show", run.run_id)
    assert f"run:         {run.run_id}" in out
    assert "status:      failed" in out
    assert f"parent:      {parent.run_id}" in out
    assert "tags:        concurrency:tenant:acme, team:red" in out
    assert 'input:       {"n": 1}' in out
    steps = [line.split()[:3] for line in out.split("No steps")[0].splitlines() if line[:1].isdigit()]
    assert steps == [["0", "load", "completed"], ["1", "send", "failed"]]

    detail = json.loads(durable("show", run.run_id, "--json")[0])
    assert (detail["run_id"], detail["parent"], detail["input"], detail["error"]) == (
        run.run_id,
        parent.run_id,
        {"n": 1},
        {"message": "boom"},
    )
    assert detail["tags"] == ["concurrency:tenant:acme", "team:red"]
    assert [(s["position"], s["name"], s["output"]) for s in detail["steps"]] == [(0, "load", {"rows": 2}), (1, "send", None)]


def test_show_of_an_unknown_run_is_an_error() -> None:
    with pytest.raises(CommandError, match="No run has the id 'nope'"):
        durable("show", "nope")


def test_show_does_not_see_another_namespace_when_given_one() -> None:
    run = WorkflowRunFactory(namespace="green")
    with pytest.raises(CommandError, match="No run has the id"):
        durable("show", run.run_id, "--namespace", "blue")


# -- cancel ----------------------------------------------------------------------------


def test_cancel_cancels_unfinished_runs_and_reports_finished_ones() -> None:
    pending = WorkflowRunFactory(status=RunStatus.PENDING)
    running = WorkflowRunFactory(status=RunStatus.RUNNING)
    tagged(running, "concurrency:tenant:acme")
    completed = WorkflowRunFactory(status=RunStatus.COMPLETED)

    out, _ = durable("cancel", pending.run_id, running.run_id, completed.run_id)

    for run in (pending, running, completed):
        run.refresh_from_db()
    assert (pending.status, running.status, completed.status) == (RunStatus.CANCELLED, RunStatus.CANCELLED, RunStatus.COMPLETED)
    assert models.RunTag.objects.get(run=running).status == RunStatus.CANCELLED  # the slot is free
    assert "Cancelled 2 runs." in out
    assert f"1 run had already finished and was left as it was: {completed.run_id} (completed)." in out


def test_cancel_with_an_unknown_run_id_cancels_nothing() -> None:
    pending = WorkflowRunFactory(status=RunStatus.PENDING)
    with pytest.raises(CommandError, match="No run has the id 'missing'. Nothing was cancelled."):
        durable("cancel", pending.run_id, "missing")
    pending.refresh_from_db()
    assert pending.status == RunStatus.PENDING


def test_cancel_reports_progress_on_stderr() -> None:
    runs = [WorkflowRunFactory(status=RunStatus.PENDING) for _ in range(3)]
    _, err = durable("cancel", *(r.run_id for r in runs))
    assert "cancel: [" in err and "3/3 (100%)" in err
    assert set(models.WorkflowRun.objects.values_list("status", flat=True)) == {RunStatus.CANCELLED}
    # -v 0: no progress line
    more = WorkflowRunFactory(status=RunStatus.PENDING)
    out, err = io.StringIO(), Terminal()
    call_command("durable", "cancel", more.run_id, verbosity=0, stdout=out, stderr=err)
    assert err.getvalue() == ""
    # Not a terminal: a line every few seconds only (none for a quick command).
    last = WorkflowRunFactory(status=RunStatus.PENDING)
    err = io.StringIO()
    call_command("durable", "cancel", last.run_id, stdout=out, stderr=err)
    assert err.getvalue() == ""


# -- retry -----------------------------------------------------------------------------


def test_retry_restarts_failed_runs(django_capture_on_commit_callbacks: Any) -> None:
    run = add_run(RunStatus.FAILED, "retry-ok", attempt=2, error={"message": "boom"}, finished_at=timezone.now())
    StepRecordFactory(run=run, position=0, name="add", outcome="failed")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        out, _ = durable("retry", run.run_id)
    run.refresh_from_db()
    assert (run.status, run.attempt, run.error, run.finished_at) == (RunStatus.PENDING, 0, None, None)
    assert not run.steps.exists()  # the failed step runs again
    assert len(callbacks) == 1  # handed to a worker on commit
    assert "Retried 1 run: pending again." in out


def test_retry_of_an_unfinished_or_completed_run_changes_nothing() -> None:
    failed = add_run(RunStatus.FAILED, "retry-no")
    completed = add_run(RunStatus.COMPLETED, "retry-no")
    with pytest.raises(CommandError, match=rf"{completed.run_id} \(completed\). Nothing was retried."):
        durable("retry", failed.run_id, completed.run_id)
    failed.refresh_from_db()
    assert failed.status == RunStatus.FAILED
    with pytest.raises(CommandError, match="Nothing was retried"):
        durable("retry", failed.run_id, "unknown")
    failed.refresh_from_db()
    assert failed.status == RunStatus.FAILED


def test_retry_refused_by_a_full_quota_is_reported_and_the_others_go_on() -> None:
    for _ in range(3):
        add_run(RunStatus.RUNNING, "retry-full")
    refused = add_run(RunStatus.FAILED, "retry-full")
    other = add_run(RunStatus.FAILED, "retry-room")
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError, match="1 of 2 runs were not retried"):
        call_command("durable", "retry", refused.run_id, other.run_id, stdout=out, stderr=err)
    refused.refresh_from_db()
    other.refresh_from_db()
    assert (refused.status, other.status) == (RunStatus.FAILED, RunStatus.PENDING)
    assert f"Could not retry run {refused.run_id}:" in err.getvalue()
    assert "Retried 1 run" in out.getvalue()


# -- quotas ----------------------------------------------------------------------------


def test_quotas_lists_busy_keys_full_ones_and_every_key() -> None:
    for _ in range(3):
        add_run(RunStatus.RUNNING, "acme")
    add_run(RunStatus.PENDING, "globex")
    add_run(RunStatus.COMPLETED, "idle")

    out, _ = durable("quotas")
    rows = [line.split()[:4] for line in out.splitlines()]
    assert rows == [["KEY", "ACTIVE", "LIMIT", "QUEUED"], ["acme", "3", "3", "0"], ["globex", "1", "3", "0"]]

    def keys(*args: str) -> list[str]:
        return [row["key"] for row in json.loads(durable("quotas", "--json", *args)[0])]

    assert keys("--full") == ["acme"]
    assert keys("--all") == ["acme", "globex", "idle"]
    assert keys("--key", "idle") == ["idle"]
    detail = json.loads(durable("quotas", "--json", "--key", "acme")[0])[0]
    assert (detail["active"], detail["limit"], detail["queued"]) == (3, 3, 0)
    assert detail["oldest_active_at"] is not None
    with pytest.raises(CommandError, match="No concurrency key 'nope' is known"):
        durable("quotas", "--key", "nope")


def test_quotas_reads_keys_a_page_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from durable.management.commands import durable as command

    monkeypatch.setattr(command, "_QUOTA_PAGE", 2)
    for key in ("k1", "k2", "k3", "k4", "k5"):
        add_run(RunStatus.RUNNING, key)
    assert [row["key"] for row in json.loads(durable("quotas", "--json")[0])] == ["k1", "k2", "k3", "k4", "k5"]


# -- purge -----------------------------------------------------------------------------


def test_purge_deletes_old_finished_runs_with_their_rows() -> None:
    old = [finished_run(status, timedelta(days=40)) for status in ("completed", "cancelled", "failed", "dead")]
    recent = finished_run(RunStatus.COMPLETED, timedelta(days=2))
    active = WorkflowRunFactory(status=RunStatus.RUNNING)
    tagged(active, "concurrency:tenant:acme")
    models.ConcurrencyLock.objects.create(key="tenant:acme", limit=1)

    out, err = durable("purge", "--older-than", "30d", "--batch-size", "3")

    assert "Deleted 4 runs finished before" in out
    assert "(completed: 1, cancelled: 1, failed: 1, dead: 1)" in out
    assert "purge: [" in err and "4/4 (100%)" in err
    gone = [r.pk for r in old]
    assert not models.WorkflowRun.objects.filter(pk__in=gone).exists()
    assert not models.RunTag.objects.filter(run_id__in=gone).exists()
    assert not models.StepRecord.objects.filter(run_id__in=gone).exists()
    assert not models.Signal.objects.filter(run_id__in=gone).exists()
    assert set(models.WorkflowRun.objects.values_list("pk", flat=True)) == {recent.pk, active.pk}
    assert models.RunTag.objects.filter(run=active).exists() and models.StepRecord.objects.filter(run=recent).exists()
    assert models.ConcurrencyLock.objects.filter(key="tenant:acme").exists()


def test_purge_pauses_between_batches_as_long_as_a_batch_took_times_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    from durable import retention

    for _ in range(5):
        finished_run(RunStatus.COMPLETED, timedelta(days=40))
    clock = iter(range(0, 1000, 2))  # each batch takes 2 "seconds" by this clock
    monkeypatch.setattr(retention, "monotonic", lambda: next(clock))
    pauses: list[float] = []
    monkeypatch.setattr(retention, "sleep", pauses.append)

    out, _ = durable("purge", "--older-than", "30d", "--status", "completed", "--batch-size", "2", "--pause-factor", "1.5")

    assert "Deleted 5 runs" in out
    # Batches of 2, 2 and 1 run: a pause after each batch but the last.
    assert pauses == [3.0, 3.0]
    assert not models.WorkflowRun.objects.exists()

    pauses.clear()
    finished_run(RunStatus.COMPLETED, timedelta(days=40))
    durable("purge", "--older-than", "30d", "--batch-size", "1", "--pause-factor", "0")
    assert pauses == []


def test_purge_by_status_and_dry_run() -> None:
    completed = finished_run(RunStatus.COMPLETED, timedelta(hours=13))
    failed = finished_run(RunStatus.FAILED, timedelta(hours=13))

    out, _ = durable("purge", "--older-than", "12h", "--status", "failed", "--dry-run")
    assert "Would delete 1 run finished before" in out and "(failed: 1)" in out and "nothing was deleted" in out
    assert models.WorkflowRun.objects.count() == 2

    out, _ = durable("purge", "--older-than", "720m", "--status", "failed")
    assert "Deleted 1 run" in out
    assert list(models.WorkflowRun.objects.values_list("pk", flat=True)) == [completed.pk]
    assert not models.RunTag.objects.filter(run_id=failed.pk).exists()


def test_purge_keeps_the_runs_a_lifetime_cap_counts() -> None:
    capped = WorkflowRunFactory(status=RunStatus.COMPLETED, finished_at=timezone.now() - timedelta(days=40))
    tagged(capped, TAG_PREFIX + "cap:acme")
    models.ConcurrencyLock.objects.create(key="cap:acme", limit=1, count_statuses=["pending", "running", "completed"])
    plain = finished_run(RunStatus.COMPLETED, timedelta(days=40))

    out, _ = durable("purge", "--older-than", "30d", "--dry-run")
    assert "Would delete 1 run finished before" in out
    out, _ = durable("purge", "--older-than", "30d")
    assert "Deleted 1 run" in out
    assert list(models.WorkflowRun.objects.values_list("pk", flat=True)) == [capped.pk]
    assert not models.WorkflowRun.objects.filter(pk=plain.pk).exists()


def test_purge_keeps_a_parent_with_an_unfinished_child_and_unlinks_finished_children() -> None:
    waiting_parent = finished_run(RunStatus.FAILED, timedelta(days=2))
    WorkflowRunFactory(status=RunStatus.RUNNING, parent=waiting_parent)
    parent = finished_run(RunStatus.COMPLETED, timedelta(days=2))
    child = finished_run(RunStatus.COMPLETED, timedelta(hours=1), parent=parent)

    out, _ = durable("purge", "--older-than", "1d")

    assert "Deleted 1 run" in out
    assert models.WorkflowRun.objects.filter(pk=waiting_parent.pk).exists()
    child.refresh_from_db()
    assert child.parent_id is None
    assert not models.WorkflowRun.objects.filter(pk=parent.pk).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "30x"], "--older-than: '30x' is not a duration"),
        (["--older-than=-3d"], "is not a duration"),
        (["--older-than", "30d", "--status", "running"], "Unknown finished status 'running'"),
        (["--older-than", "30d", "--status", "complete"], "Unknown finished status 'complete'"),
        (["--older-than", "30d", "--batch-size", "0"], "--batch-size must be between 1 and 50000"),
        (["--older-than", "30d", "--pause-factor", "-1"], "--pause-factor must be between 0 and 100"),
        (["--older-than", "30d", "--pause-factor", "nan"], "--pause-factor must be between 0 and 100"),
        ([], "the following arguments are required: --older-than"),
    ],
)
def test_purge_refuses_bad_input_and_deletes_nothing(args: list[str], message: str) -> None:
    finished_run(RunStatus.COMPLETED, timedelta(days=400))
    with pytest.raises(CommandError, match=message):
        durable("purge", *args)
    assert models.WorkflowRun.objects.count() == 1


def test_purge_in_one_namespace() -> None:
    blue = finished_run(RunStatus.COMPLETED, timedelta(days=2), namespace="blue")
    green = finished_run(RunStatus.COMPLETED, timedelta(days=2), namespace="green")
    durable("purge", "--older-than", "1d", "--namespace", "blue")
    assert list(models.WorkflowRun.objects.values_list("pk", flat=True)) == [green.pk]
    assert blue.pk not in models.RunTag.objects.values_list("run_id", flat=True)


def test_an_unknown_subcommand_is_an_error() -> None:
    with pytest.raises(CommandError, match="invalid choice"):
        durable("vacuum")


# -- the progress line -------------------------------------------------------------------


def test_progress_rewrites_one_line_on_a_terminal_and_writes_lines_elsewhere() -> None:
    written: list[str] = []
    tty = Progress(written.append, "purge", 10, tty=True)
    tty.advance(5)
    tty.advance(5)
    tty.finish()
    assert written[0].startswith("\rpurge: [###############...............] 5/10 (50%)")
    assert written[-1].startswith("\rpurge: [##############################] 10/10 (100%)") and written[-1].endswith("\n")

    written.clear()
    log = Progress(written.append, "purge", 10, tty=False, interval=3600)
    log.advance(5)
    log.finish()
    assert written == []  # nothing within the interval, and nothing to close
    log.interval = 0
    log.advance(5)
    log.finish()
    assert all(line.endswith("\n") and not line.startswith("\r") for line in written) and len(written) == 2


def test_runs_json_is_what_the_table_shows() -> None:
    run = RunTagFactory().run
    rows = json.loads(durable("runs", "--json")[0])
    assert rows[0]["run_id"] == run.run_id and rows[0]["status"] == run.status
