"""The HTTP API's views: thin, each delegating to the engine or a read query.

Every view authenticates with the project's DRF authentication classes, checks
``DURABLE["API_PERMISSION_CLASSES"]`` and then serves the request with the
engine of the request's tenant (``durable.api.tenancy.request_engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import Prefetch, QuerySet
from rest_framework import generics, status
from rest_framework import permissions as drf_permissions
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.pagination import BasePagination
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from durable import exceptions, models, querysets, quotas, schedules
from durable.api import errors, idempotency, pagination, parsers, permissions, serializers, tenancy
from durable.concurrency import MAX_KEY_LENGTH
from durable.runtime.engine import Engine, RunHandle
from durable.runtime.starting import MAX_RUN_ID_LENGTH
from durable.util import check_json


def runs(engine: Engine) -> querysets.RunQuerySet:
    """The runs ``engine`` may read, newest first, ready for ``RunSerializer`` (no N+1)."""
    return (
        models.WorkflowRun.objects.in_namespace(engine.read_namespace)
        .select_related("parent")
        .prefetch_related(
            Prefetch("tags", queryset=models.RunTag.objects.order_by("tag")),
            Prefetch("steps", queryset=models.StepRecord.objects.order_by("position")),
        )
        .order_by("-created_at", "-id")
    )


class DurableAPIView(generics.GenericAPIView):
    """Base of the API's views: JSON bodies, configured permissions, per-tenant engine."""

    parser_classes = [parsers.StrictJSONParser]
    pagination_class: type[BasePagination] | None = pagination.PageNumberPagination
    engine: Engine

    def get_permissions(self) -> list[BasePermission]:
        return permissions.get_permissions()

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # authentication, permissions, throttling
        self.engine = tenancy.request_engine(request)

    def get_exception_handler(self) -> Callable[[Exception, dict[str, Any]], Response | None]:
        # durable's errors are mapped here even when the project did not install
        # durable.api.exception_handler; everything else goes to the project's handler.
        project_handler = super().get_exception_handler()

        def handle(exc: Exception, context: dict[str, Any]) -> Response | None:
            response = errors.durable_error_response(exc)
            if response is None:
                response = project_handler(exc, context)
                if response is not None and isinstance(exc, APIException):
                    _add_code(response, exc)
            return response

        return handle

    def get_run(self, run_id: str) -> models.WorkflowRun:
        """The run ``run_id`` as this request's engine may read it, or ``RunNotFound`` (404)."""
        run = runs(self.engine).filter(run_id=_check_run_id(run_id)).first()
        if run is None:
            raise exceptions.RunNotFound(f"No run has the id {run_id!r}.", run_id=run_id)
        return run


class RunListView(DurableAPIView):
    """``GET runs/``: the runs, newest first, paged by cursor; ``?workflow=``, ``?status=``
    (repeatable or comma separated) and ``?tag=`` filter them.

    ``POST runs/`` ``{"workflow", "input", "run_id"?}``: start a run through the
    engine, under its quotas. 201 with the new run, 200 with the existing run when
    ``run_id`` names one already.

    ``POST runs/?dry_run=1`` (same body): would that start be admitted now? 200
    with ``Engine.would_admit``'s answer ``{"admitted", "outcome", "key", "limit",
    "active", "keys", ...}``; nothing is created. 400 and 404 as a start.
    """

    pagination_class = pagination.RunCursorPagination

    def get_serializer_class(self) -> type[BaseSerializer]:
        if self.request is not None and self.request.method == "POST":
            return serializers.StartRunSerializer
        return serializers.RunSerializer

    def get_queryset(self) -> querysets.RunQuerySet:
        filters = serializers.RunFilterSerializer.from_query(self.request.query_params)
        filters.is_valid(raise_exception=True)
        qs = runs(self.engine)
        if "workflow" in filters.validated_data:
            qs = qs.filter(workflow=filters.validated_data["workflow"])
        if "tag" in filters.validated_data:
            qs = qs.with_tag(filters.validated_data["tag"])
        return qs.with_statuses(filters.validated_data.get("status"))

    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(serializers.RunSerializer(page, many=True, context={"request": request}).data)

    def post(self, request: Request) -> Response:
        dry_run = _flag(request.query_params, "dry_run")
        key = idempotency.key_of(request.headers)
        serializer = serializers.StartRunSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if key is not None and data.get("run_id") is not None:
            raise ValidationError(
                {"run_id": [f"Give either run_id or the {idempotency.HEADER} header, not both."]}, code="invalid"
            )
        if dry_run:
            run_id = data.get("run_id") if key is None else idempotency.run_id(self.engine.namespace, key)
            check = self.engine.would_admit(data["workflow"], data["input"], run_id=run_id)
            return Response(check.as_dict(), status=status.HTTP_200_OK)
        handle = self.perform_start(serializer, key)
        run = self.get_run(handle.run_id)
        if key is not None and not handle.created:
            idempotency.check_same_request(run, data["workflow"], check_json(data["input"], what="the workflow input"))
        code = status.HTTP_201_CREATED if handle.created else status.HTTP_200_OK
        return Response(serializers.RunSerializer(run, context={"request": request}).data, status=code)

    def perform_start(self, serializer: serializers.StartRunSerializer, idempotency_key: str | None = None) -> RunHandle:
        # An explicit run id of another tenant's or another workflow's run raises
        # RunIdTaken (409): the engine never hands out a run the start did not mean.
        data = serializer.validated_data
        run_id = data.get("run_id")
        if idempotency_key is not None:
            run_id = idempotency.run_id(self.engine.namespace, idempotency_key)
        try:
            return self.engine.start(data["workflow"], data["input"], run_id=run_id)
        except exceptions.RunIdTaken:
            if idempotency_key is None:
                raise
            # The key's run is another workflow's: a new request under an old key.
            raise idempotency.IdempotencyKeyReused(
                f"This {idempotency.HEADER} was first used to start a run of another workflow; send a new key for a new request."
            ) from None


class RunDetailView(DurableAPIView):
    """``GET runs/<run_id>/``: one run with its tags and steps."""

    serializer_class = serializers.RunSerializer

    def get(self, request: Request, run_id: str) -> Response:
        return Response(serializers.RunSerializer(self.get_run(run_id), context={"request": request}).data)


class RunCancelView(DurableAPIView):
    """``POST runs/<run_id>/cancel/``: cancel a run (200 with the run; 409 if it has finished)."""

    serializer_class = serializers.RunSerializer

    def post(self, request: Request, run_id: str) -> Response:
        self.engine.cancel(_check_run_id(run_id))  # RunNotFound (404) for another tenant's run
        return Response(serializers.RunSerializer(self.get_run(run_id), context={"request": request}).data)


class RunSignalView(DurableAPIView):
    """``POST runs/<run_id>/signal/`` ``{"name", "payload"?}``: deliver a signal (202 with
    the run). A run waiting for it resumes; otherwise it is buffered until the run
    waits for it. 404 unknown run, 409 finished run."""

    serializer_class = serializers.SignalSerializer

    def post(self, request: Request, run_id: str) -> Response:
        serializer = serializers.SignalSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        self.engine.signal(_check_run_id(run_id), data["name"], data["payload"])
        return Response(
            serializers.RunSerializer(self.get_run(run_id), context={"request": request}).data, status=status.HTTP_202_ACCEPTED
        )


class QuotaListView(DurableAPIView):
    """``GET quotas/``: every concurrency key with its in-flight and queued counts, by
    key, paged by cursor; only the page's keys are counted."""

    serializer_class = serializers.QuotaSerializer
    pagination_class = pagination.QuotaCursorPagination

    def get_queryset(self) -> QuerySet[models.ConcurrencyLock]:
        return quotas.visible_locks(self.engine.read_namespace)

    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset()) or []
        infos = quotas.infos_for(page, namespace=self.engine.read_namespace)
        return self.get_paginated_response(serializers.QuotaSerializer(infos, many=True).data)


class QuotaDetailView(DurableAPIView):
    """``GET quotas/<key>/``: one concurrency key (keys may contain ``/``)."""

    serializer_class = serializers.QuotaSerializer

    def get(self, request: Request, key: str) -> Response:
        infos: list[quotas.QuotaInfo] = []
        if _valid_lookup(key, MAX_KEY_LENGTH):
            infos = quotas.quota_infos(namespace=self.engine.read_namespace, key=key)
        if not infos:
            raise NotFound(f"No concurrency key {key!r} is known.", code="quota_not_found")
        return Response(serializers.QuotaSerializer(infos[0]).data)


class QuotaLimitView(DurableAPIView):
    """``PUT quotas/<key>/limit/`` ``{"limit", "reason"}`` (staff only): set the key's
    limit override (``null`` clears it: the code's limit applies again), recorded
    with the user and the reason. 200 with the key and the change. The next start
    of the key applies it; runs in flight are never cancelled by it."""

    serializer_class = serializers.LimitOverrideSerializer

    def get_permissions(self) -> list[BasePermission]:
        return [*super().get_permissions(), drf_permissions.IsAdminUser()]

    def put(self, request: Request, key: str) -> Response:
        if not _valid_lookup(key, MAX_KEY_LENGTH):
            raise ValidationError({"key": [f"A concurrency key is 1 to {MAX_KEY_LENGTH} characters, without NUL."]})
        serializer = serializers.LimitOverrideSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        change = self.engine.set_limit_override(key, data["limit"], data["reason"], user=request.user)
        row = models.ConcurrencyLock.objects.get(key=key)
        info = quotas.infos_for([row], namespace=self.engine.read_namespace)[0]
        body = dict(serializers.QuotaSerializer(info).data)
        body["change"] = serializers.LimitChangeSerializer(change).data
        return Response(body)


# -- schedules -------------------------------------------------------------------------

#: API name of a field whose ``Schedule`` model name differs (in error bodies).
_SCHEDULE_API_FIELDS = {"interval_seconds": "every"}


def schedules_of(engine: Engine) -> QuerySet[models.Schedule]:
    """The schedules ``engine`` may see (those of its namespace when its reads are fenced), by name."""
    qs = models.Schedule.objects.order_by("name")
    namespace = engine.read_namespace
    return qs if namespace is None else qs.filter(namespace=namespace)


class ScheduleMixin:
    engine: Engine

    def get_schedule(self, name: str) -> models.Schedule:
        """The schedule ``name`` as this request may see it, or ``ScheduleNotFound`` (404)."""
        found = schedules_of(self.engine).filter(name=name).first() if _valid_lookup(name, schedules.MAX_NAME_LENGTH) else None
        if found is None:
            raise exceptions.ScheduleNotFound(f"No schedule is named {name!r}.", name=name)
        return found


class ScheduleListView(ScheduleMixin, DurableAPIView):
    """``GET schedules/``: the schedules, by name, paginated.

    ``POST schedules/``: create a schedule (and its beat entry) in the request's
    namespace. 201 with the schedule; 400 with ``{field: [message]}`` when a
    setting is invalid, and then nothing is created.
    """

    def get_serializer_class(self) -> type[BaseSerializer]:
        if self.request is not None and self.request.method == "POST":
            return serializers.CreateScheduleSerializer
        return serializers.ScheduleSerializer

    def get_queryset(self) -> QuerySet[models.Schedule]:
        return schedules_of(self.engine)

    def get(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(serializers.ScheduleSerializer(page, many=True).data)

    def post(self, request: Request) -> Response:
        serializer = serializers.CreateScheduleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        schedule = self.perform_create(serializer)
        return Response(serializers.ScheduleSerializer(schedule).data, status=status.HTTP_201_CREATED)

    def perform_create(self, serializer: serializers.CreateScheduleSerializer) -> models.Schedule:
        data = serializer.validated_data
        try:
            return schedules.create_schedule(
                data["name"],
                data["workflow"],
                data["input"],
                cron=data["cron"] or None,
                every=data["every"],
                timezone=data["timezone"],
                namespace=self.engine.namespace,
                concurrency_key=data["concurrency_key"],
                concurrency_limit=data["concurrency_limit"],
                enabled=data["enabled"],
            )
        except exceptions.InvalidScheduleError as exc:
            raise ValidationError(
                {_SCHEDULE_API_FIELDS.get(field, field): messages for field, messages in exc.errors.items()}
            ) from exc


class ScheduleDetailView(ScheduleMixin, DurableAPIView):
    """``GET schedules/<name>/``: one schedule."""

    serializer_class = serializers.ScheduleSerializer

    def get(self, request: Request, name: str) -> Response:
        return Response(serializers.ScheduleSerializer(self.get_schedule(name)).data)


class SchedulePauseView(ScheduleMixin, DurableAPIView):
    """``POST schedules/<name>/pause/``: disable the schedule (200 with it; pausing twice is fine)."""

    serializer_class = serializers.ScheduleSerializer

    def post(self, request: Request, name: str) -> Response:
        schedule = schedules.pause(self.get_schedule(name))
        return Response(serializers.ScheduleSerializer(schedule).data)


class ScheduleResumeView(ScheduleMixin, DurableAPIView):
    """``POST schedules/<name>/resume/``: enable the schedule again (200 with it)."""

    serializer_class = serializers.ScheduleSerializer

    def post(self, request: Request, name: str) -> Response:
        schedule = schedules.resume(self.get_schedule(name))
        return Response(serializers.ScheduleSerializer(schedule).data)


def _check_run_id(run_id: str) -> str:
    """``run_id`` if it could name a run, else ``RunNotFound`` (a URL may hold anything)."""
    if not _valid_lookup(run_id, MAX_RUN_ID_LENGTH):
        raise exceptions.RunNotFound(f"No run has the id {run_id!r}.", run_id=run_id)
    return run_id


def _flag(query: Any, name: str) -> bool:
    """A boolean query parameter: absent, ``0``/``false``/``no`` or empty are false;
    ``1``/``true``/``yes`` true; anything else is a 400."""
    value = query.get(name)
    if value is None or value.lower() in ("", "0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise ValidationError({name: [f"Must be 1 or 0 (true or false), got {value!r}."]}, code="invalid")


def _valid_lookup(value: str, max_length: int) -> bool:
    """Whether ``value`` can name a row at all (a NUL would make PostgreSQL raise)."""
    return 0 < len(value) <= max_length and "\x00" not in value


def _add_code(response: Response, exc: APIException) -> None:
    """Give ``{"detail": ...}`` error bodies the error's code, as durable's own errors have."""
    data = response.data
    if isinstance(data, dict) and set(data) == {"detail"}:
        codes = exc.get_codes()
        if isinstance(codes, str):
            data["code"] = codes
