"""Database models: runs, their tags, the per-key lock rows and the step journal."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

from durable.querysets import RunQuerySet, RunTagQuerySet
from durable.status import ACTIVE_STATUSES, RunStatus


class WorkflowRun(models.Model):
    run_id = models.CharField(max_length=255, unique=True)
    workflow = models.CharField(max_length=255, db_index=True)
    version = models.CharField(max_length=64)
    namespace = models.CharField(max_length=100, default="default", db_index=True)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    input = models.JSONField(null=True)
    output = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    #: How many times a worker has started executing this run.
    attempt = models.PositiveIntegerField(default=0)
    #: Bumped by every retry; part of the Celery task id, so that revoking a
    #: cancelled run's messages never revokes those of its retry.
    generation = models.PositiveIntegerField(default=0)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    #: Token of the execution that owns the run while it is ``running``.
    lease = models.CharField(max_length=32, blank=True, default="")
    worker = models.CharField(max_length=255, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = models.Manager.from_queryset(RunQuerySet)()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(
                fields=["status", "heartbeat_at"],
                name="durable_run_active_idx",
                condition=models.Q(status__in=ACTIVE_STATUSES),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} {self.run_id} ({self.status})"


class RunTag(models.Model):
    """A tag of a run. ``status`` mirrors the run's status so that counting the
    in-flight runs of a tag is one index range scan on ``(tag, status)``, whose
    cost does not grow with the number of finished runs."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="tags")
    tag = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=RunStatus.choices)
    namespace = models.CharField(max_length=100, default="default")
    #: The run's other concurrency tags, joined: the group a queued run belongs to
    #: when this tag's freed slots are handed out round-robin.
    group_key = models.CharField(max_length=1024, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    objects = models.Manager.from_queryset(RunTagQuerySet)()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "tag"], name="durable_tag_unique")]
        indexes = [models.Index(fields=["tag", "status", "namespace"], name="durable_tag_count_idx")]

    def __str__(self) -> str:
        return self.tag


class ConcurrencyLock(models.Model):
    """One row per concurrency key: admission locks it with SELECT ... FOR UPDATE.

    ``limit`` and ``count_statuses`` are the last values a start used, shown by
    the admin and the quota API.
    """

    key = models.CharField(max_length=255, primary_key=True)
    limit = models.IntegerField(null=True, blank=True)
    count_statuses = models.JSONField(default=list, blank=True)
    #: The group the last round-robin hand-off of this key went to.
    rr_cursor = models.CharField(max_length=1024, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "concurrency quota"

    def __str__(self) -> str:
        return self.key


class StepRecord(models.Model):
    """The journal: one row per finished step of a run, at its position."""

    class Outcome(models.TextChoices):
        COMPLETED = "completed"
        FAILED = "failed"

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="steps")
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
        constraints = [
            models.UniqueConstraint(fields=["run", "position"], name="durable_step_position_unique")
        ]

    def __str__(self) -> str:
        return f"{self.position}: {self.name}"
