"""``path("durable/", include("durable.api.urls"))``: the HTTP API (namespace ``durable``)."""

from __future__ import annotations

from django.urls import URLPattern, path

from durable.api import views

app_name = "durable"

# Quota keys may contain "/", and so may the ids of runs created before run ids
# were refused one (``durable.runtime.starting._check_run_id``: no "/", no control
# characters, which ``path`` cannot match either). The sub-resources of a run come
# before its detail route so that ``runs/<id>/cancel/`` (or ``signal/``) is never read as a run id.
urlpatterns: list[URLPattern] = [
    path("runs/", views.RunListView.as_view(), name="run-list"),
    path("runs/<path:run_id>/cancel/", views.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<path:run_id>/signal/", views.RunSignalView.as_view(), name="run-signal"),
    path("runs/<path:run_id>/", views.RunDetailView.as_view(), name="run-detail"),
    path("quotas/", views.QuotaListView.as_view(), name="quota-list"),
    path("quotas/<path:key>/limit/", views.QuotaLimitView.as_view(), name="quota-limit"),
    path("quotas/<path:key>/", views.QuotaDetailView.as_view(), name="quota-detail"),
    # Schedule names never contain "/".
    path("schedules/", views.ScheduleListView.as_view(), name="schedule-list"),
    path("schedules/<str:name>/pause/", views.SchedulePauseView.as_view(), name="schedule-pause"),
    path("schedules/<str:name>/resume/", views.ScheduleResumeView.as_view(), name="schedule-resume"),
    path("schedules/<str:name>/", views.ScheduleDetailView.as_view(), name="schedule-detail"),
]
