"""Django admin pages over the reliable_beat tables: operate it without SQL.

Every page is read-only for active staff users by default (viewing needs no permission
beyond ``is_staff``). Each action needs its own permission and shows a confirmation page
first; it then calls reliable_beat's API (the same functions as the CLI), so validation,
misfire rules and fencing are the CLI's:

=====================  ======================================  ============================
action                 API                                     permission
=====================  ======================================  ============================
pause / resume         ``entries.pause`` / ``entries.resume``  ``reliable_beat.pause_entry``
trigger now            ``ops.actions.trigger``                 ``reliable_beat.trigger_entry``
backfill a window      ``ops.actions.backfill``                ``reliable_beat.backfill_entry``
requeue a dead letter  ``ops.requeue.requeue``                  ``reliable_beat.requeue_deadletter``
=====================  ======================================  ============================

Nothing is ever requeued automatically; a requeue is a person's decision and records who.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.checks import ModelAdminChecks
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from reliable_beat import entries as rb_entries
from reliable_beat.contrib.django import conf
from reliable_beat.contrib.django.models import (
    Attempt,
    DeadLetter,
    Entry,
    OutboxMessage,
    Process,
    Run,
    StoreDateTimeField,
    Workflow,
)
from reliable_beat.errors import ConfigurationError, EntryValidationError, ReliableBeatError
from reliable_beat.groups import schedule_group_of
from reliable_beat.ops import actions as ops_actions
from reliable_beat.ops import describe as ops_describe
from reliable_beat.ops import requeue as ops_requeue
from reliable_beat.ops.context import Operator
from reliable_beat.ops.entries import build_definition, quarantine_problems, schedule_text
from reliable_beat.ops.reads import outbox_backlog
from reliable_beat.policies import MAX_CATCH_UP_LIMIT, MISSED_MARGIN_SECONDS, is_missed
from reliable_beat.redaction import MASK, is_sensitive_name, redact_text, redact_value

CONFIRM_TEMPLATE = "admin/reliable_beat/confirm_action.html"


def _who(request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    return f"django:{getattr(user, 'get_username', lambda: '?')()}"


def shown_json(value: Any) -> str:
    """A stored JSON value as the CLI shows it: secrets masked (``"api_key": "***"``, see
    :func:`reliable_beat.redaction.redact_value`), keys sorted; ``-`` for NULL. A value of
    the wrong shape is shown as stored (masked the same way), never an error."""
    if value is None:
        return "-"
    return json.dumps(redact_value(value), ensure_ascii=False, sort_keys=True, default=str)


def shown_text(value: Any) -> str:
    """A stored error text with secrets masked as the CLI masks them; ``-`` for NULL; a JSON
    error (a workflow's) as :func:`shown_json`."""
    if isinstance(value, (dict, list)):
        return shown_json(value)
    return "-" if value is None else redact_text(value)


def unmask(submitted: Any, stored: Any) -> Any:
    """``submitted`` (parsed JSON from a form) with every ``"***"`` at a sensitive key
    replaced by the value ``stored`` holds at the same place: a masked value copied from a
    page never overwrites the secret with ``***``. Where ``stored`` has no value there,
    ``"***"`` is kept as typed."""
    if isinstance(submitted, dict) and isinstance(stored, dict):
        return {k: (stored[k] if v == MASK and is_sensitive_name(k) and k in stored
                    else unmask(v, stored.get(k))) for k, v in submitted.items()}
    if isinstance(submitted, list) and isinstance(stored, list):
        return [unmask(v, stored[i] if i < len(stored) else None)
                for i, v in enumerate(submitted)]
    return submitted


#: model fields shown through a redacting display method (``<name>_shown``) on every page
_REDACTED_JSON = ("args", "kwargs", "options", "result", "payload", "headers")
_REDACTED_TEXT = ("error", "last_error")


class _ReadOnlyAdmin(admin.ModelAdmin):
    """Viewing for active staff; no add, change or delete (writes go through the API).

    JSON columns (args, kwargs, options, result, payload, headers) and error texts are shown
    redacted as the CLI shows them (:mod:`reliable_beat.redaction`); the stored values are
    untouched (a requeue sends what is stored)."""

    list_per_page = 50

    @admin.display(description="args")
    def args_shown(self, obj: Any) -> str:
        return shown_json(obj.args)

    @admin.display(description="kwargs")
    def kwargs_shown(self, obj: Any) -> str:
        return shown_json(obj.kwargs)

    @admin.display(description="options")
    def options_shown(self, obj: Any) -> str:
        return shown_json(obj.options)

    @admin.display(description="result")
    def result_shown(self, obj: Any) -> str:
        return shown_json(obj.result)

    @admin.display(description="payload")
    def payload_shown(self, obj: Any) -> str:
        return shown_json(obj.payload)

    @admin.display(description="headers")
    def headers_shown(self, obj: Any) -> str:
        return shown_json(obj.headers)

    @admin.display(description="error")
    def error_shown(self, obj: Any) -> str:
        return shown_text(obj.error)

    @admin.display(description="last error")
    def last_error_shown(self, obj: Any) -> str:
        return shown_text(obj.last_error)

    def _shown_fields(self) -> list[str]:
        return [f"{f.name}_shown" if f.name in (*_REDACTED_JSON, *_REDACTED_TEXT) else f.name
                for f in self.model._meta.fields]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self._shown_fields()

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_module_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self._shown_fields()

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def _perm(self, request: HttpRequest, codename: str) -> bool:
        return bool(request.user.is_active and request.user.has_perm(f"reliable_beat.{codename}"))

    def _confirm(self, request: HttpRequest, queryset: QuerySet[Any], *, action: str,
                 title: str, question: str, items: list[str],
                 form: forms.Form | None = None) -> HttpResponse:
        """The confirmation page; posting it back runs the action (``confirm=yes``)."""
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "question": question,
            "items": items,
            "form": form,
            "action": action,
            "selected": [str(pk) for pk in queryset.values_list("pk", flat=True)],
            "opts": self.model._meta,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, CONFIRM_TEMPLATE, context)


class BackfillForm(forms.Form):
    """The window of a backfill: ``[start, end)``, ISO 8601 instants with a UTC offset."""

    start = forms.CharField(help_text="e.g. 2026-01-10T00:00:00Z (offset required)")
    end = forms.CharField(help_text="exclusive; e.g. 2026-01-11T00:00:00Z")
    force = forms.BooleanField(required=False,
                               help_text="allow more slots than reliable_beat_backfill_limit")

    @staticmethod
    def _instant(value: str, what: str) -> datetime:
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise forms.ValidationError(f"{what}: {value!r} is not an ISO 8601 instant") from None
        if parsed.tzinfo is None:
            raise forms.ValidationError(f"{what}: {value!r} has no UTC offset (add Z or +02:00)")
        return parsed

    def clean_start(self) -> datetime:
        return self._instant(self.cleaned_data["start"], "start")

    def clean_end(self) -> datetime:
        return self._instant(self.cleaned_data["end"], "end")


class RuntimeEntryForm(forms.Form):
    """A runtime entry, as ``reliable-beat entries add|update`` takes it (blank = not given;
    on edit, not given = kept). Validated by the CLI's own ``build_definition``
    (:func:`reliable_beat.ops.entries.build_definition`).

    ``group`` is the schedule group (``--group``): blank on add = the Celery app's group (no
    app: none, any beat fires it); blank on edit = kept. A ``"***"`` at a sensitive key of
    ``args`` / ``kwargs`` (as the pages show secrets) keeps the stored value there."""

    name = forms.CharField(max_length=200)
    task = forms.CharField(max_length=255, required=False)
    cron = forms.CharField(required=False, help_text="croniter syntax; 6 fields = seconds LAST")
    every = forms.IntegerField(required=False, min_value=1, help_text="interval, whole seconds")
    at = forms.CharField(required=False, help_text="one-off instant, ISO 8601 with offset")
    timezone = forms.CharField(required=False, help_text="IANA zone (blank: the app's zone)")
    args = forms.CharField(required=False, help_text="JSON array")
    kwargs = forms.CharField(required=False, help_text="JSON object")
    group = forms.CharField(required=False, max_length=200, help_text=(
        "schedule group whose beats fire it (blank: the Celery app's group; no app: none, "
        "any beat)"))
    queue = forms.CharField(required=False)
    misfire_policy = forms.ChoiceField(required=False, choices=[
        ("", "-"), ("skip", "skip"), ("fire_once", "fire_once"), ("catch_up", "catch_up")])
    misfire_grace = forms.FloatField(required=False, min_value=0, help_text="seconds")
    catch_up_limit = forms.IntegerField(required=False, min_value=0,
                                        max_value=MAX_CATCH_UP_LIMIT)
    overlap_policy = forms.ChoiceField(required=False, choices=[
        ("", "-"), ("allow", "allow"), ("skip", "skip"), ("buffer_one", "buffer_one")])
    dst_nonexistent = forms.ChoiceField(required=False, choices=[
        ("", "-"), ("shift", "shift"), ("gap_end", "gap_end"), ("skip", "skip")],
        help_text="cron only: what a local time inside a DST gap gets")
    dst_repeated = forms.ChoiceField(required=False, choices=[
        ("", "-"), ("first", "first"), ("last", "last"), ("both", "both")],
        help_text="cron only: what a local time that occurs twice gets")

    def params(self) -> dict[str, Any]:
        """The cleaned values as the CLI's parameters (blank -> None; ``group`` apart)."""
        return {k: (None if v in ("", None) else v) for k, v in self.cleaned_data.items()
                if k not in ("name", "group")}


def _keep_masked_secrets(params: dict[str, Any], existing: dict[str, Any]) -> None:
    """In place: ``args`` / ``kwargs`` given as JSON get each ``"***"`` at a sensitive key
    replaced by the stored value (:func:`unmask`); text that is not JSON is left for the
    CLI's validation to report."""
    for what in ("args", "kwargs"):
        text = params.get(what)
        if text is None or MASK not in text:
            continue
        try:
            parsed = json.loads(text)
        except ValueError:
            continue
        params[what] = json.dumps(unmask(parsed, existing.get(what)))


@admin.register(Entry)
class EntryAdmin(_ReadOnlyAdmin):
    list_display = ("name", "task", "schedule_in_words", "state", "next_fire_local",
                    "last_fire_at", "misfire_policy", "overlap_policy", "origin")
    list_filter = ("origin", "schedule_group", "paused", "enabled", "schedule_kind")
    search_fields = ("name", "task")
    actions = ["pause_entries", "resume_entries", "trigger_entries", "backfill_entries"]
    change_form_template = "admin/reliable_beat/entry_change_form.html"
    change_list_template = "admin/reliable_beat/entry_change_list.html"
    entry_form_template = "admin/reliable_beat/entry_form.html"

    def get_urls(self) -> list[Any]:
        from django.urls import path

        wrap = self.admin_site.admin_view
        return [
            path("add-runtime/", wrap(self.runtime_entry_view),
                 name="reliable_beat_entry_add_runtime"),
            path("<path:object_id>/edit-runtime/", wrap(self.runtime_entry_view),
                 name="reliable_beat_entry_edit_runtime"),
            *super().get_urls(),
        ]

    def has_edit_permission(self, request: HttpRequest) -> bool:
        return self._perm(request, "edit_entry")

    def runtime_entry_view(self, request: HttpRequest, object_id: str | None = None
                           ) -> HttpResponse:
        """Add (no ``object_id``) or edit a runtime entry, validated like the CLI's
        ``entries add|update`` (same function), written with ``save_runtime_entry``."""
        from django.core.exceptions import PermissionDenied
        from django.shortcuts import redirect

        if not self.has_edit_permission(request):
            raise PermissionDenied
        store = conf.store()
        existing: dict[str, Any] | None = None
        if object_id is not None:
            obj = self.get_object(request, object_id)
            if obj is None:
                return redirect("admin:reliable_beat_entry_changelist")
            existing = rb_entries.get_entry(store, obj.name)
            if existing["origin"] == "config":
                self.message_user(request, f"{obj.name} comes from beat_schedule "
                                  "(CELERY_BEAT_SCHEDULE): change it there", messages.ERROR)
                return redirect("admin:reliable_beat_entry_change", obj.pk)
        initial = {"name": existing["name"]} if existing else {}
        form = RuntimeEntryForm(request.POST or None, initial=initial)
        ctx = Operator(app=conf.celery_app(), store=store, database_url=conf.store_url())
        app_zone = ctx.app_timezone
        where = "the Celery app's zone" if ctx.app is not None else "no Celery app found"
        if existing is not None:
            form.fields["name"].disabled = True  # the name is the entry's identity
            form.fields["timezone"].help_text = (
                f"IANA zone; blank keeps {existing['timezone'] or app_zone}")
            form.fields["group"].help_text = (
                f"schedule group; blank keeps {existing.get('schedule_group') or 'none'}")
            for what in ("args", "kwargs"):
                form.fields[what].help_text = (
                    f"JSON {'array' if what == 'args' else 'object'}; blank keeps the stored "
                    f"{what}. Secrets are shown as {MASK}: a {MASK} left at a secret's key "
                    "keeps the stored secret; type a new value to change it")
        else:
            form.fields["timezone"].help_text = f"IANA zone; blank: {app_zone} ({where})"
        problems: list[str] = []
        if request.method == "POST" and form.is_valid():
            name = existing["name"] if existing else form.cleaned_data["name"]
            params = form.params()
            if existing is not None:
                _keep_masked_secrets(params, existing)
            try:
                if existing is None and params.get("task") is None:
                    raise EntryValidationError([f"entry {name!r}: task is required"])
                definition = build_definition(ctx, name, params, existing=existing,
                                              form=True)
                group = form.cleaned_data.get("group") or None
                if group is None and existing is None and ctx.app is not None:
                    group = schedule_group_of(ctx.app, ctx.settings.schedule_group)
                rb_entries.save_runtime_entry(store, definition, create=existing is None,
                                              schedule_group=group, form=True)
            except EntryValidationError as exc:
                problems = list(exc.problems)
            except ReliableBeatError as exc:
                problems = [str(exc)]
            else:
                self.message_user(request, f"{'changed' if existing else 'added'} runtime "
                                  f"entry {name}", messages.SUCCESS)
                return redirect("admin:reliable_beat_entry_change",
                                rb_entries.get_entry(store, name)["id"])
        context = {
            **self.admin_site.each_context(request),
            "title": f"Edit runtime entry {existing['name']}" if existing
                     else "Add a runtime entry",
            "form": form, "problems": problems, "existing": existing,
            "existing_schedule": self.schedule_in_words_of(existing) if existing else "",
            "opts": self.model._meta,
        }
        return TemplateResponse(request, self.entry_form_template, context)

    @admin.display(description="schedule")
    def schedule_in_words(self, obj: Entry) -> str:
        # a malformed stored schedule (a quarantined row) is shown as stored, not decoded
        return schedule_text(obj.schedule if obj.schedule is not None else {})

    @staticmethod
    def schedule_in_words_of(row: dict[str, Any]) -> str:
        """A stored entry row's schedule as ``entries list`` shows it (``cron '0 2 * * *'
        Europe/Berlin``), with its zone, misfire and overlap policies."""
        spec = row.get("schedule")
        return (f"{schedule_text(spec if spec is not None else {})}; zone "
                f"{row.get('timezone')}; misfire {row.get('misfire_policy')}; overlap "
                f"{row.get('overlap_policy')}")

    @admin.display(description="status")
    def state(self, obj: Entry) -> str:
        if obj.quarantine_reason:
            reason = obj.quarantine_reason
            return f"quarantined: {reason[:160]}{'...' if len(reason) > 160 else ''}"
        if not obj.enabled:
            return "disabled"
        if obj.paused:
            return "paused"
        return "active" if obj.next_fire_at is not None else "ended"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # the store's clock read with the rows (design invariant 4): the MISSED check
        return super().get_queryset(request).annotate(rb_store_now=Now())

    @staticmethod
    def missed(obj: Entry) -> bool:
        """``reliable-beat status``'s MISSED flag of this entry (the same function:
        :func:`reliable_beat.policies.is_missed`, on the store's clock)."""
        if obj.quarantine_reason or not obj.enabled or obj.paused:
            return False
        now = getattr(obj, "rb_store_now", None)
        if not isinstance(now, datetime) or now.tzinfo is None:
            store = conf.store()
            with store.engine.connect() as conn:
                now = store.now(conn)
        return is_missed(obj.next_fire_at, obj.misfire_grace_seconds, now)

    @admin.display(description="next fire (entry's zone)", ordering="next_fire_at")
    def next_fire_local(self, obj: Entry) -> str:
        if obj.next_fire_at is None:
            return "-"
        if not isinstance(obj.next_fire_at, datetime):  # a MalformedTimestamp: as stored
            return str(obj.next_fire_at)
        try:
            zone = ZoneInfo(obj.timezone or "UTC")
        except Exception:
            zone = ZoneInfo("UTC")
        text = obj.next_fire_at.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z")
        if self.missed(obj):
            text += (" (MISSED: overdue by more than its misfire grace + "
                     f"{MISSED_MARGIN_SECONDS:g} s: no beat is claiming entries; see "
                     "`reliable-beat status`)")
        return text

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self._perm(request, "pause_entry")

    def has_trigger_permission(self, request: HttpRequest) -> bool:
        return self._perm(request, "trigger_entry")

    def has_backfill_permission(self, request: HttpRequest) -> bool:
        return self._perm(request, "backfill_entry")

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = dict(extra_context or {})
        obj = self.get_object(request, object_id)
        if obj is not None:
            extra["recent_runs"] = list(
                Run.objects.using(conf.database_alias()).filter(entry_name=obj.name)
                .order_by("-created_at", "-id")[:10])
            if obj.quarantine_reason:
                extra["quarantine_note"] = (
                    f"Quarantined {obj.quarantined_at:%Y-%m-%d %H:%M:%S} UTC, it does not fire "
                    f"until fixed: {obj.quarantine_reason}"
                    if isinstance(obj.quarantined_at, datetime) else
                    f"Quarantined, it does not fire until fixed: {obj.quarantine_reason}")
            try:
                extra["describe"] = ops_describe.describe(conf.store(), conf.celery_app(), obj.name)
            except ReliableBeatError as exc:
                extra["describe_error"] = str(exc)
            except Exception as exc:  # a malformed stored value the description cannot read
                extra["describe_error"] = (f"cannot describe {obj.name!r}: a stored value is "
                                           f"malformed ({type(exc).__name__}: {exc})")
            if obj.origin == "config":
                extra["origin_note"] = (
                    "This entry comes from the Celery app's beat_schedule (CELERY_BEAT_SCHEDULE "
                    "in Django settings): edit it there; a starting beat syncs it. Pause, "
                    "resume, trigger and backfill work here.")
            extra["next_fire_local"] = self.next_fire_local(obj)
            extra["can_edit_runtime"] = (obj.origin == "runtime"
                                         and self.has_edit_permission(request))
            extra["schedule_in_words"] = self.schedule_in_words(obj)
        return super().change_view(request, object_id, form_url, extra)

    def changelist_view(self, request: HttpRequest,
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {**(extra_context or {}), "can_edit_runtime": self.has_edit_permission(request)}
        return super().changelist_view(request, extra)

    def _each(self, request: HttpRequest, queryset: QuerySet[Any], verb: str,
              fn: Any) -> None:
        done = []
        for entry in queryset:
            try:
                result = fn(entry.name)
            except ReliableBeatError as exc:
                self.message_user(request, f"{entry.name}: not {verb}: {exc}", messages.ERROR)
                continue
            done.append(f"{entry.name}{result or ''}")
        if done:
            self.message_user(request, f"{verb}: {', '.join(done)}", messages.SUCCESS)

    @admin.action(description="Pause selected entries", permissions=["pause"])
    def pause_entries(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        if request.POST.get("confirm") != "yes":
            return self._confirm(
                request, queryset, action="pause_entries", title="Pause entries",
                question="Pause these entries? They stop firing; their grid is kept.",
                items=[e.name for e in queryset])
        self._each(request, queryset, "paused",
                   lambda name: rb_entries.pause(conf.store(), name))
        return None

    @admin.action(description="Resume selected entries", permissions=["pause"])
    def resume_entries(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        if request.POST.get("confirm") != "yes":
            return self._confirm(
                request, queryset, action="resume_entries", title="Resume entries",
                question="Resume these entries? Slots missed while paused go through each "
                         "entry's misfire policy, as after downtime.",
                items=[f"{e.name} (misfire policy {e.misfire_policy})" for e in queryset])
        self._each(request, queryset, "resumed", self._resume_one)
        return None

    @staticmethod
    def _resume_one(name: str) -> None:
        """Resume ``name``; a quarantined row that is still malformed stays quarantined
        (checked as the beat checks it) and nothing changes."""
        store = conf.store()
        problems = quarantine_problems(store, name)
        if problems:
            raise ConfigurationError(
                "stays quarantined, its row is still malformed: " + "; ".join(problems)
                + ". Fix the values named (runtime entries: 'Edit this runtime entry'; "
                "config entries: beat_schedule), then resume it")
        rb_entries.resume(store, name)

    @admin.action(description="Trigger selected entries now", permissions=["trigger"])
    def trigger_entries(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        if request.POST.get("confirm") != "yes":
            return self._confirm(
                request, queryset, action="trigger_entries", title="Trigger entries now",
                question="Run each of these entries once, now, outside its schedule? "
                         "(a manual run with its own key; the relay delivers the trigger)",
                items=[f"{e.name} -> {e.task}" for e in queryset])
        self._each(request, queryset, "triggered",
                   lambda name: f" ({ops_actions.trigger(conf.store(), name)})")
        return None

    @admin.action(description="Backfill a window of the selected entries",
                  permissions=["backfill"])
    def backfill_entries(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        form = BackfillForm(request.POST if request.POST.get("confirm") == "yes" else None)
        if request.POST.get("confirm") != "yes" or not form.is_valid():
            return self._confirm(
                request, queryset, action="backfill_entries", title="Backfill entries",
                question="Create the runs of every slot in [start, end) that has none "
                         "(never a second run for a slot):",
                items=[e.name for e in queryset], form=form)
        limit = conf.store_settings().backfill_limit

        def one(name: str) -> str:
            result = ops_actions.backfill(
                conf.store(), name, form.cleaned_data["start"], form.cleaned_data["end"],
                limit=limit, force=form.cleaned_data["force"])
            return f" ({result.created} created, {result.existing} existing)"

        self._each(request, queryset, "backfilled", one)
        return None


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    can_delete = False
    fields = ("attempt", "fence_token", "outcome", "worker", "started_at", "finished_at",
              "retry_in_seconds", "error_shown")
    readonly_fields = fields

    @admin.display(description="error")
    def error_shown(self, obj: Attempt) -> str:
        return shown_text(obj.error)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class _StoreFieldChecks(ModelAdminChecks):  # type: ignore[misc]
    """Django's admin checks, with ``date_hierarchy`` on a :class:`StoreDateTimeField` (a
    ``DateTimeField`` whose internal type differs so that no backend converter reads its
    text) accepted as the ``DateTimeField`` it is."""

    def _check_date_hierarchy(self, obj: Any) -> list[Any]:
        field = obj.model._meta.get_field(obj.date_hierarchy) if obj.date_hierarchy else None
        if isinstance(field, StoreDateTimeField):
            return []
        return list(super()._check_date_hierarchy(obj))


@admin.register(Run)
class RunAdmin(_ReadOnlyAdmin):
    checks_class = _StoreFieldChecks
    list_display = ("idempotency_key", "entry_name", "fire_at", "state", "attempts",
                    "fence_token", "trigger", "finished_at")
    list_filter = ("state", "trigger", "entry_name")
    search_fields = ("idempotency_key", "entry_name", "task")
    date_hierarchy = "created_at"
    inlines = [AttemptInline]

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The list; its date drill-down is left out while a listed ``created_at`` is not an
        instant (``'infinity'`` written by hand: Django's drill-down cannot bucket it), and
        a message says which value; every row is still listed."""
        from django.db.models import Max, Min

        cl = super().get_changelist_instance(request)
        if cl.date_hierarchy:
            span = cl.queryset.aggregate(first=Min("created_at"), last=Max("created_at"))
            bad = sorted({str(v) for v in span.values() if v is not None and
                          not isinstance(v, datetime)})
            if bad:
                cl.date_hierarchy = None
                self.message_user(request, "date drill-down off: a run's created_at is not "
                                  f"an instant ({', '.join(bad)}); fix that row's created_at",
                                  messages.WARNING)
        return cl


@admin.register(DeadLetter)
class DeadLetterAdmin(_ReadOnlyAdmin):
    list_display = ("id", "kind", "key", "task", "destination", "reason", "attempts",
                    "created_at", "requeued_at", "requeued_by")
    list_filter = ("kind", "reason")
    search_fields = ("key", "task", "entry_name")
    actions = ["requeue"]

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return self._perm(request, "requeue_deadletter")

    @admin.action(description="Requeue selected dead letters (run again, same key)",
                  permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        if request.POST.get("confirm") != "yes":
            return self._confirm(
                request, queryset, action="requeue", title="Requeue dead letters",
                question="Run these again under the SAME idempotency key (a dropped message: "
                         "send it again; an outbox row: deliver it again)? A run whose effect "
                         "committed is refused.",
                items=[f"#{d.pk} {d.task or d.destination} {d.key!r} (died: {d.reason}, "
                       f"{d.attempts} attempts)" for d in queryset])
        app: Any = None
        store = conf.store()
        for dl in queryset:
            try:  # checked first: a requeue that cannot be sent must not be recorded
                plan = ops_requeue.plan_requeue(store, {
                    "id": dl.pk, "kind": dl.kind, "payload": dl.payload, "reason": dl.reason,
                    "key": dl.key, "attempts": dl.attempts, "destination": dl.destination})
            except ValueError as exc:
                self.message_user(request, f"#{dl.pk}: not requeued: {exc}", messages.ERROR)
                continue
            if plan.needs == ops_requeue.CELERY and app is None:
                app = conf.celery_app()
                if app is None:
                    self.message_user(
                        request, "requeue sends the task through the Celery app: set "
                        "RELIABLE_BEAT = {'CELERY_APP': 'proj.celery:app'} in settings",
                        messages.ERROR)
                    return None
            try:
                done = ops_requeue.requeue(store, plan, app=app, by=_who(request))
            except ops_actions.RequeueSendError as exc:
                self.message_user(request, f"#{dl.pk}: {exc}", messages.ERROR)
                continue
            except (ValueError, LookupError) as exc:
                self.message_user(request, f"#{dl.pk}: not requeued: {exc}", messages.ERROR)
                continue
            self.message_user(request, f"#{dl.pk}: requeued {plan.payload['task']} under key "
                              f"{plan.payload['key']!r}" if plan.what == "run"
                              else f"#{dl.pk}: {done}", messages.SUCCESS)
        return None


@admin.register(OutboxMessage)
class OutboxAdmin(_ReadOnlyAdmin):
    list_display = ("id", "message_id", "destination", "schedule_group", "state", "attempts",
                    "available_at", "sent_at", "last_error_shown")
    list_filter = ("state", "destination", "schedule_group")
    search_fields = ("message_id", "destination")
    change_list_template = "admin/reliable_beat/outbox_change_list.html"

    def changelist_view(self, request: HttpRequest,
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        with conf.store().engine.connect() as conn:
            backlog = outbox_backlog(conn, datetime.now(timezone.utc))
        return super().changelist_view(request, {**(extra_context or {}),
                                                 "backlog": backlog})


@admin.register(Workflow)
class WorkflowAdmin(_ReadOnlyAdmin):
    list_display = ("workflow_id", "name", "version", "state", "schedule_group", "run_no",
                    "history_len", "updated_at", "finished_at")
    list_filter = ("state", "schedule_group", "name")
    search_fields = ("workflow_id", "name", "entry_name")


@admin.register(Process)
class ProcessAdmin(_ReadOnlyAdmin):
    """Beats and relays by heartbeat: a schedule group with none alive has nothing that
    publishes its rows (``reliable-beat status`` says so: NO BEAT, UNSERVED OUTBOX)."""

    list_display = ("owner", "role", "schedule_group", "destinations", "started_at",
                    "seen_at", "stopped_at")
    list_filter = ("role", "schedule_group")
    search_fields = ("owner", "schedule_group")
