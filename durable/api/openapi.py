"""The OpenAPI 3 schema of durable's HTTP API, made by drf-spectacular (the ``openapi`` extra).

``path("durable/schema/", include("durable.api.schema_urls"))`` serves it (YAML,
or JSON with ``?format=json``), describing durable's endpoints only, at the
paths your URLconf mounts them on. Nothing in the project's own settings is
needed: each view of durable is given this module's ``DurableSchema`` (through
drf-spectacular's view extensions) when the schema is made, whatever
``DEFAULT_SCHEMA_CLASS`` says.

Every operation lists the status codes it really answers, with their bodies:
429 with its ``Retry-After`` header and the limit's fields, 400, 404, 409, 415
and 422 with ``{"detail", "code"}`` (or DRF's ``{field: [message]}``), and 401/403.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension, OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_basic_type
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, PolymorphicProxySerializer
from drf_spectacular.views import SpectacularAPIView
from rest_framework import serializers as drf
from rest_framework.permissions import BasePermission

import durable
from durable.api import idempotency, permissions, serializers, views
from durable.status import ALL_STATUSES


class ErrorSerializer(drf.Serializer):
    """The body of durable's errors."""

    detail = drf.CharField(help_text="What went wrong, for a person.")
    code = drf.CharField(help_text="A stable code, e.g. run_not_found, run_id_taken, invalid_start.")


class ConcurrencyLimitErrorSerializer(ErrorSerializer):
    """The body of a 429: the quota that refused the start."""

    workflow = drf.CharField()
    key = drf.CharField(help_text="The full concurrency key.")
    limit = drf.IntegerField()
    active = drf.IntegerField(help_text="Runs it counts now.")
    queued = drf.IntegerField(required=False, help_text="code concurrency_queue_full only: runs queued on the key.")
    max_queued = drf.IntegerField(required=False, help_text="code concurrency_queue_full only.")
    source = drf.ChoiceField(  # type: ignore[assignment]
        choices=["pool", "up_to"],
        required=False,
        help_text="A key with a burst only: what refused, its burst pool (full, while the key's guaranteed "
        "slots are taken) or its ceiling up_to (guaranteed and borrowed runs in flight).",
    )
    pool = drf.CharField(required=False, help_text="A key with a burst only: the pool it borrows from.")
    pool_limit = drf.IntegerField(required=False, help_text="A key with a burst only: the pool's limit in effect.")
    pool_active = drf.IntegerField(required=False, help_text="A key with a burst only: runs holding a slot of the pool.")
    up_to = drf.IntegerField(required=False, help_text="A key with a burst only: its most runs in flight in all.")
    borrowed = drf.IntegerField(required=False, help_text="A key with a burst only: how many of active are borrowed.")
    retry_after = drf.IntegerField(
        help_text="Seconds to wait before starting again, the same figure as the Retry-After header: estimated "
        "per key (the median duration of its last finished runs minus the age of its oldest run in flight, "
        "between 1 and RETRY_AFTER_MAX), RETRY_AFTER when nothing is measured."
    )


ERROR = ErrorSerializer
#: DRF's validation errors, ``{field: [message]}``, or durable's ``{"detail", "code"}``.
INVALID = OpenApiResponse(OpenApiTypes.OBJECT, description='{"field": ["message"]} or {"detail": ..., "code": ...}.')


def _error(description: str) -> OpenApiResponse:
    return OpenApiResponse(ERROR, description=description)


@dataclass(frozen=True)
class Operation:
    """What the schema says of one endpoint and method."""

    operation_id: str
    summary: str
    responses: dict[int, Any]
    request: Any = None
    is_list: bool = False
    parameters: list[OpenApiParameter] = field(default_factory=list)


AUTH = {
    401: _error("Not authenticated (DRF's authentication classes of the project)."),
    403: _error("Refused by API_PERMISSION_CLASSES, or no namespace for this user (API_NAMESPACE)."),
}
RUN_NOT_FOUND = {404: _error("No run has this id (or it is another tenant's): code run_not_found.")}
MEDIA = {415: _error("The body is not application/json.")}
RETRY_AFTER = OpenApiParameter(
    "Retry-After",
    OpenApiTypes.INT,
    location=OpenApiParameter.HEADER,
    response=[429],
    description="Seconds to wait before starting again: the body's retry_after (estimated per key, "
    "between 1 and RETRY_AFTER_MAX; RETRY_AFTER when nothing is measured).",
)
DRY_RUN = OpenApiParameter(
    "dry_run",
    OpenApiTypes.STR,
    location=OpenApiParameter.QUERY,
    required=False,
    enum=["1", "0", "true", "false"],
    description="1: only answer whether this start would be admitted now (200 with an AdmissionCheck); nothing is created.",
)
#: ``POST runs/`` answers 200 with the existing run, or with a dry run's answer.
START_OK = PolymorphicProxySerializer(
    component_name="StartRunOk",
    serializers=[serializers.RunSerializer, serializers.AdmissionCheckSerializer],
    resource_type_field_name=None,
)
IDEMPOTENCY_KEY = OpenApiParameter(
    idempotency.HEADER,
    OpenApiTypes.STR,
    location=OpenApiParameter.HEADER,
    required=False,
    description="Retries of one start send the same key: the first creates the run (201), "
    "a retry returns it (200). Mapped to a run id within the caller's namespace.",
)
RUN_FILTERS = [
    OpenApiParameter("workflow", OpenApiTypes.STR, description="Only runs of this workflow."),
    OpenApiParameter(
        "status",
        OpenApiTypes.STR,
        many=True,
        enum=sorted(ALL_STATUSES),
        description="Only runs in these statuses (repeat the parameter, or separate with commas).",
    ),
    OpenApiParameter("tag", OpenApiTypes.STR, description='Only runs with this tag, e.g. "concurrency:tenant:acme".'),
]

OPERATIONS: dict[tuple[type, str], Operation] = {
    (views.RunListView, "GET"): Operation(
        "listRuns",
        "List runs, newest first, paged by cursor",
        {
            200: serializers.RunSerializer,
            400: INVALID,
            404: _error("Invalid cursor."),
        },
        is_list=True,
        parameters=RUN_FILTERS,
    ),
    (views.RunListView, "POST"): Operation(
        "startRun",
        "Start a run under its workflow's quotas",
        {
            201: OpenApiResponse(serializers.RunSerializer, description="The run was created."),
            200: OpenApiResponse(
                START_OK,
                description="run_id (or Idempotency-Key) names an existing run of this start: it is returned. "
                "With ?dry_run=1: whether the start would be admitted now (an AdmissionCheck); nothing is created.",
            ),
            400: INVALID,
            404: _error("No workflow of that name: code unknown_workflow."),
            409: _error("run_id is taken by another run: code run_id_taken."),
            **MEDIA,
            422: _error("The Idempotency-Key was used for another request: code idempotency_key_reused."),
            429: OpenApiResponse(
                ConcurrencyLimitErrorSerializer,
                description="A quota is full (code concurrency_limit) or its queue is (concurrency_queue_full); "
                "nothing was created.",
            ),
        },
        request=serializers.StartRunSerializer,
        parameters=[IDEMPOTENCY_KEY, RETRY_AFTER, DRY_RUN],
    ),
    (views.RunDetailView, "GET"): Operation(
        "getRun", "One run, with its tags and steps", {200: serializers.RunSerializer, **RUN_NOT_FOUND}
    ),
    (views.RunCancelView, "POST"): Operation(
        "cancelRun",
        "Cancel a run",
        {
            200: serializers.RunSerializer,
            **RUN_NOT_FOUND,
            409: _error("The run has finished already: code run_terminal."),
        },
    ),
    (views.RunSignalView, "POST"): Operation(
        "signalRun",
        "Send a signal to a run",
        {
            202: OpenApiResponse(serializers.RunSerializer, description="Delivered, or buffered until the run waits for it."),
            400: INVALID,
            **RUN_NOT_FOUND,
            409: _error("The run has finished already: code run_terminal."),
            **MEDIA,
        },
        request=serializers.SignalSerializer,
    ),
    (views.QuotaListView, "GET"): Operation(
        "listQuotas",
        "List concurrency keys with their counts, by key, paged by cursor",
        {200: serializers.QuotaSerializer, 404: _error("Invalid cursor.")},
        is_list=True,
    ),
    (views.QuotaDetailView, "GET"): Operation(
        "getQuota",
        "One concurrency key",
        {200: serializers.QuotaSerializer, 404: _error("No such key: code quota_not_found.")},
    ),
    (views.QuotaLimitView, "PUT"): Operation(
        "setQuotaLimit",
        "Set or clear a concurrency key's limit override (staff only)",
        {
            200: OpenApiResponse(
                serializers.QuotaLimitSerializer, description="The key with its limit in effect, and the change recorded."
            ),
            400: INVALID,
            **MEDIA,
        },
        request=serializers.LimitOverrideSerializer,
    ),
    (views.ScheduleListView, "GET"): Operation(
        "listSchedules",
        "List schedules, by name",
        {200: serializers.ScheduleSerializer, 404: _error("Page out of range.")},
        is_list=True,
    ),
    (views.ScheduleListView, "POST"): Operation(
        "createSchedule",
        "Create a schedule (and its beat entry)",
        {201: serializers.ScheduleSerializer, 400: INVALID, **MEDIA},
        request=serializers.CreateScheduleSerializer,
    ),
    (views.ScheduleDetailView, "GET"): Operation(
        "getSchedule",
        "One schedule",
        {200: serializers.ScheduleSerializer, 404: _error("No schedule of that name: code schedule_not_found.")},
    ),
    (views.SchedulePauseView, "POST"): Operation(
        "pauseSchedule",
        "Pause a schedule",
        {200: serializers.ScheduleSerializer, 404: _error("No schedule of that name: code schedule_not_found.")},
    ),
    (views.ScheduleResumeView, "POST"): Operation(
        "resumeSchedule",
        "Resume a schedule",
        {200: serializers.ScheduleSerializer, 404: _error("No schedule of that name: code schedule_not_found.")},
    ),
}


class JSONValueFieldSchema(OpenApiSerializerFieldExtension):
    """A workflow's input, a signal's payload: any JSON value."""

    target_class = serializers.JSONValueField

    def map_serializer_field(self, auto_schema: AutoSchema, direction: str) -> dict[str, Any]:
        return build_basic_type(OpenApiTypes.ANY) or {}


class DurableSchema(AutoSchema):
    """drf-spectacular's schema of one durable view, from ``OPERATIONS``."""

    def _operation(self) -> Operation:
        for cls in type(self.view).__mro__:
            found = OPERATIONS.get((cls, self.method))
            if found is not None:
                return found
        raise LookupError(f"durable.api.openapi.OPERATIONS has no entry for {type(self.view).__name__} {self.method}.")

    def get_operation_id(self) -> str:
        return self._operation().operation_id

    def get_summary(self) -> str | None:
        return self._operation().summary

    def get_tags(self) -> list[str]:
        return ["durable"]

    def _is_list_view(self, serializer: Any = None) -> bool:
        return self._operation().is_list

    def get_request_serializer(self) -> Any:
        return self._operation().request

    def get_response_serializers(self) -> Any:
        return {**self._operation().responses, **AUTH}

    def get_override_parameters(self) -> list[Any]:
        return list(self._operation().parameters)


def _schema_view_of(view: type) -> type:
    """``view`` with ``DurableSchema``, for the schema generator only."""
    return type(view.__name__, (view,), {"schema": DurableSchema(), "__module__": view.__module__})


for _view in {view for view, _ in OPERATIONS}:
    # Registered by subclassing: drf-spectacular swaps each view for its replacement while it makes the schema.
    type(
        f"{_view.__name__}Schema",
        (OpenApiViewExtension,),
        {"target_class": _view, "view_replacement": lambda self, _view=_view: _schema_view_of(_view)},
    )


def durable_endpoints(endpoints: list[tuple[str, str, str, Any]], **kwargs: Any) -> list[tuple[str, str, str, Any]]:
    """drf-spectacular's preprocessing hook: only durable's own endpoints, wherever they are mounted."""
    return [endpoint for endpoint in endpoints if getattr(endpoint[3], "cls", None) in {view for view, _ in OPERATIONS}]


class DurableSchemaView(SpectacularAPIView):
    """The schema of durable's endpoints (YAML; ``?format=json`` for JSON), behind the API's permissions."""

    custom_settings = {
        "TITLE": "durable",
        "DESCRIPTION": "Durable workflows with exact per-key concurrency quotas: start runs, read them, "
        "cancel and signal them, watch quotas, manage schedules.",
        "VERSION": durable.__version__,
        "PREPROCESSING_HOOKS": ["durable.api.openapi.durable_endpoints"],
    }

    def get_permissions(self) -> list[BasePermission]:
        return permissions.get_permissions()
