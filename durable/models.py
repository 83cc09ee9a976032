"""Database models: runs, their tags, the per-key lock rows and the step journal."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Now

from durable.querysets import RunQuerySet, RunTagQuerySet
from durable.status import DEFAULT_CONCURRENCY_STATUSES, TERMINAL_STATUSES, RunStatus


class WorkflowRun(models.Model):
    #: Unique by ``durable_workflowrun_run_id_key`` (a constraint, not ``unique=True``: on
    #: PostgreSQL, Django gives a unique ``CharField`` a second, ``LIKE`` index, which
    #: no query of durable uses and every new row version would write).
    run_id = models.CharField(max_length=255)
    workflow = models.CharField(max_length=255)
    version = models.CharField(max_length=64)
    namespace = models.CharField(max_length=100, default="default")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    input = models.JSONField(null=True)
    output = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    #: How many times a worker has started executing this run.
    attempt = models.PositiveIntegerField(default=0)
    #: Bumped by every retry; part of the Celery task id, so that revoking a
    #: cancelled run's messages never revokes those of its retry.
    generation = models.PositiveIntegerField(default=0)
    #: Indexed by ``durable_run_parent_idx``, which holds the children only.
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children", db_index=False)
    #: Celery queue the run's messages go to ("" for the default queue); a remote
    #: workflow's runs go to the queue its service consumes.
    queue = models.CharField(max_length=200, blank=True, default="")
    #: What a suspended run waits for: "sleep", "signal:<name>" or "child:<run id>".
    waiting_for = models.CharField(max_length=300, blank=True, default="")
    #: When a suspended run wakes up (end of a sleep, or a signal's timeout).
    wake_at = models.DateTimeField(null=True, blank=True)
    #: Token of the execution that owns the run while it is ``running``.
    lease = models.CharField(max_length=32, blank=True, default="")
    worker = models.CharField(max_length=255, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    #: When the run's last message was sent to the workers.
    dispatched_at = models.DateTimeField(null=True, blank=True)
    #: How many times the sweeper re-sent the run since it was last sent for a
    #: reason of its own (a start, a wake-up, a hand-off, a retry) or claimed:
    #: the next re-send waits ``REDISPATCH_AFTER * 2**redispatches`` (capped).
    redispatches = models.PositiveIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: The start counted its quotas in its namespace only (an engine with
    #: ``scope_reads``); its children count theirs the same way.
    fenced = models.BooleanField(default=False, db_default=False)

    objects = models.Manager.from_queryset(RunQuerySet)()

    class Meta:
        ordering = ["-created_at", "-id"]
        # The name PostgreSQL gave the column's UNIQUE when run_id had unique=True.
        constraints = [models.UniqueConstraint(fields=["run_id"], name="durable_workflowrun_run_id_key")]
        # The lists (API and admin) read a page newest first, unfiltered or by one
        # status, workflow or namespace: each an index range in that order, whose
        # cost does not grow with the number of runs. No index names heartbeat_at,
        # dispatched_at or redispatches, nor uses them in a condition: a heartbeat, a
        # journal write and a re-send change only those, so PostgreSQL updates the row
        # in place (a HOT update) instead of adding an entry to every index. The
        # sweeper finds the running and the pending runs on durable_run_status_idx
        # and filters those few row by row.
        indexes = [
            models.Index(fields=["-created_at", "-id"], name="durable_run_created_idx"),
            models.Index(fields=["status", "-created_at", "-id"], name="durable_run_status_idx"),
            models.Index(fields=["workflow", "-created_at", "-id"], name="durable_run_workflow_idx"),
            models.Index(fields=["namespace", "-created_at", "-id"], name="durable_run_namespace_idx"),
            # A purge (and RETENTION) reads the finished runs of one status, oldest
            # finished first: one range of this index per batch.
            models.Index(
                fields=["status", "finished_at", "id"],
                name="durable_run_finished_idx",
                condition=models.Q(status__in=sorted(TERMINAL_STATUSES)),
            ),
            # The children of given runs (a cancel's, retention's). Not the top-level
            # runs, most of them: a full index of a foreign key keeps its NULLs, and
            # each start, claim and finish of every run wrote one into it.
            models.Index(
                fields=["parent"],
                name="durable_run_parent_idx",
                condition=models.Q(parent__isnull=False),
            ),
            models.Index(
                fields=["wake_at"],
                name="durable_run_wake_idx",
                condition=models.Q(status=RunStatus.SUSPENDED),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} {self.run_id} ({self.status})"


class RunTag(models.Model):
    """A tag of a run. ``status`` mirrors the run's status so that counting the
    in-flight runs of a tag is one index range scan, whose cost does not grow with
    the number of finished runs: on ``durable_tag_slot_idx``, which holds only the
    tags of runs in the default ``count_statuses`` (what PostgreSQL's functions
    count through ``durable_counted_tags``, whatever their plans), or on
    ``(tag, status)``."""

    #: No index of its own (db_index=False): the unique constraint on (run, tag) starts
    #: with it, so it serves the joins, the lookups by run and the cascade on delete.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="tags", db_index=False)
    tag = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=RunStatus.choices)
    namespace = models.CharField(max_length=100, default="default")
    #: The run's other concurrency tags, joined: the group a queued run belongs to
    #: when this tag's freed slots are handed out round-robin.
    group_key = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    objects = models.Manager.from_queryset(RunTagQuerySet)()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "tag"], name="durable_tag_unique")]
        indexes = [
            models.Index(fields=["tag", "status", "namespace"], name="durable_tag_count_idx"),
            # Its statuses are written out in durable_counted_tags (sql/counting.sql) too.
            models.Index(
                fields=["tag", "status", "namespace"],
                condition=models.Q(status__in=DEFAULT_CONCURRENCY_STATUSES),
                name="durable_tag_slot_idx",
            ),
        ]

    def __str__(self) -> str:
        return self.tag


class ConcurrencyLock(models.Model):
    """One row per concurrency key: admission locks it with SELECT ... FOR UPDATE.

    ``limit`` and ``count_statuses`` are the last values a start used (admitted
    or refused), shown by the admin and the quota API.
    """

    key = models.CharField(max_length=255, primary_key=True)
    limit = models.IntegerField(null=True, blank=True)
    count_statuses = models.JSONField(default=list, blank=True)
    #: The group the last round-robin hand-off of this key went to.
    rr_cursor = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    #: An operator's limit for this key (``Engine.set_limit_override``): while set,
    #: admission uses it instead of the code's ``limit``, read under the row's lock.
    limit_override = models.IntegerField(null=True, blank=True)
    #: Seconds the key's last runs held their slot (creation to finish), oldest
    #: first, at most ``durable.stores.base.RECENT_DURATIONS``: what a refusal's ``Retry-After`` is estimated from.
    recent_durations = models.JSONField(null=True, blank=True)
    #: When the last of ``recent_durations`` was recorded: a finish records one at
    #: most every ``durable.stores.base.DURATION_EVERY`` seconds per key, so the
    #: key's row is not rewritten by every finish of a busy key.
    durations_at = models.DateTimeField(null=True, blank=True)
    #: The key's burst as the last start declared it, ``{"pool": ..., "up_to": ...}``
    #: (``Concurrency(burst=Burst(...))``), or None: the admin and the quota API show it.
    burst = models.JSONField(null=True, blank=True)

    class Meta:
        verbose_name = "concurrency quota"

    def __str__(self) -> str:
        return self.key

    @property
    def effective_limit(self) -> int | None:
        """The limit admission applies: the override when one is set, else the code's."""
        return self.limit if self.limit_override is None else self.limit_override


class LimitChange(models.Model):
    """One change of a key's limit override, for the audit trail: who, when, the
    limit in effect before and after (``None`` in ``new_override``: cleared), and why."""

    key = models.CharField(max_length=255, db_index=True)
    #: The override before and after the change (``None``: none, the code's limit applies).
    old_override = models.IntegerField(null=True, blank=True)
    new_override = models.IntegerField(null=True, blank=True)
    #: The limit in effect before and after (the code's last known limit where no override).
    old_limit = models.IntegerField(null=True, blank=True)
    new_limit = models.IntegerField(null=True, blank=True)
    reason = models.TextField()
    changed_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    #: The user's name as it was at the change (kept when the user is deleted).
    changed_by_name = models.CharField(max_length=255, blank=True, default="")
    changed_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-changed_at", "-id"]
        verbose_name = "limit change"

    def __str__(self) -> str:
        new = "cleared" if self.new_override is None else str(self.new_override)
        return f"{self.key}: {new}"


class StepRecord(models.Model):
    """The journal: one row per finished step of a run, at its position."""

    class Outcome(models.TextChoices):
        COMPLETED = "completed"
        FAILED = "failed"
        #: A sleep or a signal wait that has begun (its deadline is in ``output``).
        WAITING = "waiting"

    #: No index of its own (db_index=False): the unique constraint on (run, position) starts
    #: with it, so it serves the joins, the lookups by run and the cascade on delete.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="steps", db_index=False)
    position = models.PositiveIntegerField()
    name = models.CharField(max_length=255)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    output = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=1)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "position"]
        constraints = [models.UniqueConstraint(fields=["run", "position"], name="durable_step_position_unique")]

    def __str__(self) -> str:
        return f"{self.position}: {self.name}"


class Signal(models.Model):
    """A signal sent to a run. Buffered until the run waits for it (then consumed at
    the journal position of that wait), so a signal sent early is never lost."""

    #: No index of its own (db_index=False): durable_signal_pending_idx starts with it.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="signals", db_index=False)
    name = models.CharField(max_length=255)
    payload = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    #: Journal position of the wait that consumed it; null while buffered.
    consumed_at_position = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["run", "id"]
        indexes = [models.Index(fields=["run", "name", "consumed_at_position"], name="durable_signal_pending_idx")]

    def __str__(self) -> str:
        return f"{self.name} -> {self.run_id}"


class Schedule(models.Model):
    """A persisted schedule: starts ``workflow`` with ``input`` on a cron or an interval.

    Driven by django-celery-beat: ``durable.schedules`` is the only writer of the
    ``PeriodicTask`` row behind each schedule. A schedule has a quota of its own
    (``concurrency_key``/``concurrency_limit``); a window refused by it is skipped
    and written to ``last_error``. Create and change schedules through
    ``durable.schedules`` (which validates them, ``durable.schedules.validation``),
    not by saving this model.
    """

    name = models.CharField(max_length=200, unique=True)
    workflow = models.CharField(max_length=255)
    input = models.JSONField(default=dict, blank=True)
    cron = models.CharField(max_length=120, blank=True, default="", help_text="minute hour day-of-month month day-of-week")
    interval_seconds = models.PositiveIntegerField(null=True, blank=True)
    timezone = models.CharField(max_length=63, default="UTC")
    enabled = models.BooleanField(default=True)
    namespace = models.CharField(max_length=100, default="default")
    concurrency_key = models.CharField(max_length=200, blank=True, default="")
    concurrency_limit = models.IntegerField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_run_id = models.CharField(max_length=255, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(cron="") & models.Q(interval_seconds__isnull=False))
                | (~models.Q(cron="") & models.Q(interval_seconds__isnull=True)),
                name="durable_schedule_cron_xor_interval",
            ),
            models.CheckConstraint(
                condition=models.Q(concurrency_key="") | models.Q(concurrency_limit__isnull=False),
                name="durable_schedule_key_has_limit",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class StepSlot(models.Model):
    """A step's claim on a slot of a step-level quota (``ctx.step(..., concurrency=...)``).

    ``held``: the step may run its body (or will, once its run is claimed again
    after a hand-off). ``waiting``: the run is parked until a slot of ``key`` is
    handed to it, oldest first. Rows are written under the key's ``ConcurrencyLock``
    row lock. A held row stops counting the moment its step's result is journaled
    or its run leaves the active statuses (the store is the truth, as for runs);
    the row itself is deleted just after (or by the sweeper).
    """

    class Status(models.TextChoices):
        HELD = "held"
        WAITING = "waiting"

    key = models.CharField(max_length=255)
    #: No index of its own (db_index=False): the unique constraint on (run, position) starts
    #: with it, so it serves the joins, the lookups by run and the cascade on delete.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="step_slots", db_index=False)
    #: The journal position of the step.
    position = models.PositiveIntegerField()
    status = models.CharField(max_length=8, choices=Status.choices)
    #: The limit the step asked for (an override on the key's lock row replaces it).
    limit = models.IntegerField()
    #: The execution running the step's body ("" for a slot handed to a parked run
    #: and not yet taken up): a held row of another lease is a dead execution's.
    lease = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    granted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["key", "id"]
        constraints = [models.UniqueConstraint(fields=["run", "position"], name="durable_stepslot_unique")]
        indexes = [models.Index(fields=["key", "status", "id"], name="durable_stepslot_key_idx")]

    def __str__(self) -> str:
        return f"{self.key}: {self.run_id}@{self.position} ({self.status})"
