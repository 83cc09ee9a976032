"""The limit changes admin: the audit trail of each key's limit override, and the
form an operator sets or clears an override with.

Adding a ``LimitChange`` is how an override is set: the form's key, limit (blank
clears the override: the code's limit applies again) and reason (required) go
to ``Engine.set_limit_override`` with the operator as the user, which locks the
key's row, writes the override and records the change in one transaction. A
change is never edited or deleted. ``?key=<key>`` lists one key's changes (the
quota page links there) and pre-fills the add form's key.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

import durable
from durable import exceptions, models
from durable.concurrency import MAX_KEY_LENGTH, MAX_LIMIT, MIN_LIMIT
from durable.runtime.limits import MAX_REASON_LENGTH


class LimitChangeForm(forms.ModelForm):
    """Set (a number) or clear (blank) the limit override of a key, with a reason."""

    key = forms.CharField(max_length=MAX_KEY_LENGTH, strip=False, help_text="The full concurrency key, e.g. tenant:acme.")
    limit = forms.IntegerField(
        required=False,
        min_value=MIN_LIMIT,
        max_value=MAX_LIMIT,
        help_text="The key's limit from now on (0 or less refuses every start). Blank clears the override: "
        "the limit in the code applies again. Runs in flight are never cancelled.",
    )
    reason = forms.CharField(
        max_length=MAX_REASON_LENGTH, widget=forms.Textarea(attrs={"rows": 3}), help_text="Why (recorded with the change)."
    )

    class Meta:
        model = models.LimitChange
        fields = ["key", "limit", "reason"]


@admin.register(models.LimitChange)
class LimitChangeAdmin(admin.ModelAdmin):
    form = LimitChangeForm
    list_display = ("key", "old_limit", "new_limit", "override", "reason", "changed_by_name", "changed_at")
    list_filter = ("changed_at",)
    search_fields = ("key", "reason", "changed_by_name")
    readonly_fields = (
        "key",
        "old_limit",
        "new_limit",
        "old_override",
        "new_override",
        "reason",
        "changed_by_name",
        "changed_at",
    )
    ordering = ("-changed_at", "-id")

    @admin.display(description="override")
    def override(self, obj: models.LimitChange) -> str:
        return "cleared" if obj.new_override is None else str(obj.new_override)

    def get_engine(self) -> durable.Engine:
        """The engine the changes go through (the default one, read at call time)."""
        return durable.engine

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else self.readonly_fields  # the add form is the only form

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ["key", "limit", "reason"] if obj is None else list(self.readonly_fields)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        return lookup == "key" or super().lookup_allowed(lookup, value, request)

    def save_model(self, request: HttpRequest, obj: models.LimitChange, form: Any, change: bool) -> None:
        data = form.cleaned_data
        try:
            self.get_engine().set_limit_override(data["key"], data["limit"], data["reason"], user=request.user)
        except exceptions.InvalidStartError as exc:  # the form checked the same rules: not expected
            raise forms.ValidationError(str(exc)) from exc
        # The row the engine wrote is this change (for the admin's log and redirect).
        written = models.LimitChange.objects.filter(key=data["key"]).order_by("-id").first()
        assert written is not None
        obj.pk = written.pk

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the audit trail is never edited

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
