"""What the HTTP API accepts and returns."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from durable import models, schedules
from durable.api import idempotency
from durable.concurrency import MAX_LIMIT, MIN_LIMIT
from durable.runtime.limits import MAX_REASON_LENGTH, OUTCOMES
from durable.status import ALL_STATUSES

#: Deepest nesting of lists and objects accepted in a run's input.
MAX_INPUT_DEPTH = 100


class TextField(serializers.CharField):
    """A string that the database can store: unlike DRF's ``CharField`` it refuses
    numbers and booleans (no silent ``123 -> "123"``) and lone surrogates."""

    default_error_messages = {
        "invalid": "Must be a string.",
        "unencodable": "Must be valid Unicode text (it contains a lone surrogate).",
    }

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        if not _encodable(data):
            self.fail("unencodable")
        return super().to_internal_value(data)


class JSONValueField(serializers.Field):
    """Any JSON value the database can store as a run's input.

    Refuses what a JSON column cannot hold (NUL characters, lone surrogates,
    non-finite numbers) and nesting deeper than ``MAX_INPUT_DEPTH``. The engine
    checks every input again with ``durable.util.check_json``; this field comes
    first for its tighter depth limit and its per-case 400 messages.
    """

    default_error_messages = {
        "not_json": "Must be a JSON value, got {type}.",
        "not_finite": "Numbers must be finite (NaN and Infinity are not JSON).",
        "nul": "Strings may not contain the NUL character (\\u0000).",
        "unencodable": "Strings must be valid Unicode text (one contains a lone surrogate).",
        "too_deep": "Nested more than {max_depth} levels deep.",
    }

    def to_internal_value(self, data: Any) -> Any:
        # Iterative walk: a deep value must not exhaust the Python stack.
        pending: list[tuple[Any, int]] = [(data, 1)]
        while pending:
            value, depth = pending.pop()
            if isinstance(value, str):
                self._check_text(value)
            elif isinstance(value, float):
                if not math.isfinite(value):
                    self.fail("not_finite")
            elif value is None or isinstance(value, (bool, int)):
                pass
            elif isinstance(value, (list, dict)):
                if depth > MAX_INPUT_DEPTH:
                    self.fail("too_deep", max_depth=MAX_INPUT_DEPTH)
                if isinstance(value, dict):
                    for key in value:
                        if not isinstance(key, str):
                            self.fail("not_json", type=f"an object key {key!r}")
                        self._check_text(key)
                    pending.extend((item, depth + 1) for item in value.values())
                else:
                    pending.extend((item, depth + 1) for item in value)
            else:
                self.fail("not_json", type=type(value).__name__)
        return data

    def to_representation(self, value: Any) -> Any:
        return value

    def _check_text(self, text: str) -> None:
        if "\x00" in text:
            self.fail("nul")
        if not _encodable(text):
            self.fail("unencodable")


class StartRunSerializer(serializers.Serializer):
    """The body of ``POST runs/``: ``{"workflow": str, "input": any JSON, "run_id"?: str}``."""

    workflow = TextField(max_length=255, help_text="Name of a registered workflow.")
    input = JSONValueField(allow_null=True, help_text="The run's input: any JSON value.")
    run_id = TextField(
        max_length=255,
        required=False,
        allow_null=True,
        help_text="Optional explicit id: starting an existing id again returns that run (idempotent).",
    )

    def validate_run_id(self, run_id: str | None) -> str | None:
        # Run ids are global: a client-chosen schedule run id would reveal another
        # tenant's schedule windows (409) or take a future one (the window fails).
        if run_id is not None and run_id.startswith(schedules.RUN_ID_PREFIX):
            raise serializers.ValidationError(
                f"Run ids starting with {schedules.RUN_ID_PREFIX!r} are reserved for the runs of schedules: "
                "choose another run id, or leave run_id out to get a new one."
            )
        # Those of Idempotency-Key starts likewise: a body could take another tenant's key's run id.
        if run_id is not None and run_id.startswith(idempotency.RUN_ID_PREFIX):
            raise serializers.ValidationError(
                f"Run ids starting with {idempotency.RUN_ID_PREFIX!r} are reserved for starts with an "
                f"{idempotency.HEADER} header: send the header, or choose another run id."
            )
        return run_id

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown_fields(self)
        return attrs


class SignalSerializer(serializers.Serializer):
    """The body of ``POST runs/<run_id>/signal/``: ``{"name": str, "payload"?: any JSON}``."""

    name = TextField(max_length=255, help_text="The signal the run waits for (or will wait for).")
    payload = JSONValueField(required=False, allow_null=True, default=None, help_text="Any JSON value.")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown_fields(self)
        return attrs


class StatusListField(serializers.Field):
    """``?status=running&status=pending`` or ``?status=running,pending``: a list of run statuses."""

    default_error_messages = {
        "invalid": "Must be a list of run statuses.",
        "unknown": "Unknown run status {status!r}; expected one of: {choices}.",
    }

    def to_internal_value(self, data: Any) -> list[str] | None:
        if isinstance(data, str):
            data = [data]
        if not isinstance(data, (list, tuple)) or not all(isinstance(item, str) for item in data):
            self.fail("invalid")
        statuses: list[str] = []
        for item in data:
            for status in (part.strip() for part in item.split(",")):
                if not status:
                    continue
                if status not in ALL_STATUSES:
                    self.fail("unknown", status=status, choices=", ".join(sorted(ALL_STATUSES)))
                if status not in statuses:
                    statuses.append(status)
        return statuses or None

    def to_representation(self, value: Any) -> Any:
        return value


class RunFilterSerializer(serializers.Serializer):
    """The query parameters of ``GET runs/``."""

    workflow = TextField(max_length=255, required=False)
    tag = TextField(max_length=255, required=False)
    status = StatusListField(required=False)

    @classmethod
    def from_query(cls, query: Any) -> RunFilterSerializer:
        """Build from ``request.query_params``; blank parameters are ignored."""
        data: dict[str, Any] = {}
        for name in ("workflow", "tag"):
            value = query.get(name)
            if value:
                data[name] = value
        statuses = query.getlist("status")
        if statuses:
            data["status"] = statuses
        return cls(data=data)


class StepSerializer(serializers.ModelSerializer):
    class Meta:
        model = models.StepRecord
        fields = ["position", "name", "outcome", "attempts", "finished_at"]
        read_only_fields = fields


class RunSerializer(serializers.ModelSerializer):
    """A run, with its tags and the journal of its finished steps.

    Expects ``parent`` selected and ``tags``/``steps`` prefetched (see ``views.runs``).
    The ``traceback`` of a failed run's ``error`` (file paths and source lines of the
    project) is shown to staff users only: give the serializer the ``request`` in its
    context, or nobody sees it.
    """

    def to_representation(self, instance: Any) -> Any:
        data = super().to_representation(instance)
        error = data.get("error")
        if isinstance(error, dict) and "traceback" in error and not _is_staff(self.context.get("request")):
            data["error"] = {name: value for name, value in error.items() if name != "traceback"}
        return data

    parent_run_id = serializers.CharField(source="parent.run_id", read_only=True, allow_null=True)
    tags: serializers.SlugRelatedField[models.RunTag] = serializers.SlugRelatedField(many=True, read_only=True, slug_field="tag")
    steps = StepSerializer(many=True, read_only=True)

    class Meta:
        model = models.WorkflowRun
        fields = [
            "run_id",
            "workflow",
            "version",
            "namespace",
            "status",
            "input",
            "output",
            "error",
            "attempt",
            "parent_run_id",
            "queue",
            "waiting_for",
            "wake_at",
            "created_at",
            "updated_at",
            "started_at",
            "finished_at",
            "tags",
            "steps",
        ]
        read_only_fields = fields


class QuotaSerializer(serializers.Serializer):
    """One concurrency key (a ``durable.quotas.QuotaInfo``)."""

    key = serializers.CharField(read_only=True)
    active = serializers.IntegerField(read_only=True, help_text="Runs in the key's count_statuses.")
    queued = serializers.IntegerField(read_only=True, help_text="Runs waiting for a slot of the key.")
    limit = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="The limit in effect: the override if one is set, else the last limit a start "
        "brought from the code (admitted or refused); null if unknown.",
    )
    code_limit = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="The last limit a start brought from the code; null if unknown."
    )
    limit_override = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="An operator's limit replacing the code's (PUT quotas/<key>/limit/); null: none.",
    )
    count_statuses = serializers.ListField(child=serializers.CharField(), read_only=True)
    oldest_active_at = serializers.DateTimeField(read_only=True, allow_null=True)
    oldest_queued_at = serializers.DateTimeField(read_only=True, allow_null=True)
    oldest_queued_age = serializers.SerializerMethodField(
        help_text="Seconds the oldest queued run has waited; null when nothing is queued."
    )
    guaranteed = serializers.IntegerField(
        read_only=True, help_text="A key with a burst or a pool only: runs of active admitted within the limit."
    )
    borrowed = serializers.IntegerField(read_only=True, help_text="Runs of active borrowed from the key's burst pool.")
    pool = serializers.CharField(
        read_only=True, allow_null=True, help_text="The pool the key borrows from (its burst); null: none."
    )
    up_to = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="The most runs of the key in flight, guaranteed and borrowed."
    )
    pool_limit = serializers.IntegerField(read_only=True, allow_null=True, help_text="The pool's limit in effect.")
    pool_active = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="Runs holding a slot of the pool (of every key that borrows from it)."
    )
    is_pool = serializers.BooleanField(read_only=True, help_text='The key is a pool of DURABLE["POOLS"].')

    #: Only for a key with a burst or a pool: a plain key's body is as it was before bursts.
    BURST_FIELDS = ("guaranteed", "borrowed", "pool", "up_to", "pool_limit", "pool_active", "is_pool")

    def to_representation(self, instance: Any) -> Any:
        data = super().to_representation(instance)
        if instance.pool is None and not instance.is_pool:
            for name in self.BURST_FIELDS:
                data.pop(name, None)
        return data

    def get_oldest_queued_age(self, info: Any) -> float | None:
        if info.oldest_queued_at is None:
            return None
        return round((timezone.now() - info.oldest_queued_at).total_seconds(), 3)


class LimitOverrideSerializer(serializers.Serializer):
    """``PUT quotas/<key>/limit/``: ``{"limit": int or null, "reason": text}``."""

    limit = serializers.IntegerField(
        allow_null=True,
        min_value=MIN_LIMIT,
        max_value=MAX_LIMIT,
        help_text="The key's new limit (0 or less refuses every start); null clears the override: the code's limit applies.",
    )
    reason = TextField(max_length=MAX_REASON_LENGTH, help_text="Why: recorded with the change.")

    def validate_limit(self, limit: Any) -> int | None:
        raw = self.initial_data.get("limit") if isinstance(self.initial_data, Mapping) else None
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int)):
            raise serializers.ValidationError("Must be an integer or null.", code="invalid")
        return limit

    def validate_reason(self, reason: str) -> str:
        if not reason.strip() or "\x00" in reason:
            raise serializers.ValidationError("Give a reason (it is recorded with the change).", code="blank")
        return reason

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown_fields(self)
        return attrs


class LimitChangeSerializer(serializers.Serializer):
    """One change of a key's limit (a ``LimitChangeRecord``)."""

    key = serializers.CharField(read_only=True)
    old_limit = serializers.IntegerField(read_only=True, allow_null=True, help_text="The limit in effect before.")
    new_limit = serializers.IntegerField(read_only=True, allow_null=True, help_text="The limit in effect now.")
    old_override = serializers.IntegerField(read_only=True, allow_null=True)
    new_override = serializers.IntegerField(read_only=True, allow_null=True)
    reason = serializers.CharField(read_only=True)
    changed_by = serializers.CharField(read_only=True, source="changed_by_name")
    changed_at = serializers.DateTimeField(read_only=True, allow_null=True)


class QuotaLimitSerializer(QuotaSerializer):
    """The answer of ``PUT quotas/<key>/limit/``: the key, and the change just made."""

    change = LimitChangeSerializer(read_only=True)


class KeyCheckSerializer(serializers.Serializer):
    """One key of a dry run."""

    key = serializers.CharField(read_only=True)
    limit = serializers.IntegerField(read_only=True, help_text="The limit in effect.")
    code_limit = serializers.IntegerField(read_only=True)
    override = serializers.IntegerField(read_only=True, allow_null=True)
    active = serializers.IntegerField(read_only=True)
    queued = serializers.IntegerField(read_only=True)
    strategy = serializers.CharField(read_only=True)
    max_queued = serializers.IntegerField(read_only=True, allow_null=True)


class AdmissionCheckSerializer(serializers.Serializer):
    """The answer of ``POST runs/?dry_run=1`` (``Engine.would_admit``)."""

    admitted = serializers.BooleanField(read_only=True, help_text="A start now would run (nothing was created).")
    outcome = serializers.ChoiceField(choices=OUTCOMES, read_only=True)
    workflow = serializers.CharField(read_only=True)
    key = serializers.CharField(read_only=True, allow_null=True, help_text="The key that decided; null without quotas.")
    limit = serializers.IntegerField(read_only=True, allow_null=True)
    active = serializers.IntegerField(read_only=True, allow_null=True)
    keys = KeyCheckSerializer(many=True, read_only=True)
    detail = serializers.CharField(read_only=True, required=False, help_text="Why, when not simply admitted.")
    retry_after = serializers.IntegerField(read_only=True, required=False, help_text="A refusal's Retry-After seconds.")


def _refuse_unknown_fields(serializer: serializers.Serializer) -> None:
    """A misspelt field ("inputs", "runId") would otherwise be ignored silently."""
    data = serializer.initial_data
    unknown = sorted(str(name) for name in data if name not in serializer.fields) if isinstance(data, Mapping) else []
    if unknown:
        raise serializers.ValidationError(
            {name: [f"Unknown field; expected {', '.join(serializer.fields)}."] for name in unknown}
        )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ScheduleSerializer(serializers.ModelSerializer):
    """A persisted schedule. ``every`` is the interval in seconds (null for a cron schedule)."""

    every = serializers.IntegerField(source="interval_seconds", read_only=True, allow_null=True)

    class Meta:
        model = models.Schedule
        fields = [
            "name",
            "workflow",
            "input",
            "cron",
            "every",
            "timezone",
            "enabled",
            "namespace",
            "concurrency_key",
            "concurrency_limit",
            "last_run_at",
            "last_run_id",
            "last_error",
            "last_error_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


class CreateScheduleSerializer(serializers.Serializer):
    """The body of ``POST schedules/``. Only the types are checked here; the
    settings themselves are validated by ``durable.schedules.create_schedule``."""

    name = TextField(max_length=200)
    workflow = TextField(max_length=255)
    input = JSONValueField(required=False, allow_null=True, default=dict)
    cron = TextField(max_length=120, required=False, allow_blank=True, allow_null=True, default="")
    every = serializers.IntegerField(required=False, allow_null=True, default=None)
    timezone = TextField(max_length=63, required=False, default="UTC")
    concurrency_key = TextField(max_length=200, required=False, allow_blank=True, default="")
    concurrency_limit = serializers.IntegerField(required=False, allow_null=True, default=None)
    enabled = serializers.BooleanField(required=False, default=True)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown_fields(self)
        return attrs


def _is_staff(request: Any) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)
