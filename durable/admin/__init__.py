"""The Django admin of durable: runs (with their steps), concurrency quotas and schedules.

Runs and quotas are read-only. A run changes state only through the engine
(``durable.engine.cancel`` / ``durable.engine.retry``, offered as actions), so
the admin never writes a status, a tag or a step row itself: the quota counts
stay exact whatever an operator clicks. Schedules are written through
``durable.schedules`` only.

Importing this package (Django's admin autodiscovery does) registers the three
``ModelAdmin`` classes.
"""

from __future__ import annotations

from durable.admin.limits import LimitChangeAdmin
from durable.admin.quotas import ConcurrencyQuotaAdmin
from durable.admin.runs import StepRecordInline, TagFilter, WorkflowRunAdmin
from durable.admin.schedules import ScheduleAdmin, ScheduleForm
from durable.status import RETRYABLE_STATUSES

__all__ = [
    "RETRYABLE_STATUSES",
    "ConcurrencyQuotaAdmin",
    "LimitChangeAdmin",
    "ScheduleAdmin",
    "ScheduleForm",
    "StepRecordInline",
    "TagFilter",
    "WorkflowRunAdmin",
]
