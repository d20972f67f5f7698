from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import path

from reliable_beat import outbox
from reliable_beat.contrib.django import atomic_connection


def order(request: HttpRequest, name: str) -> HttpResponse:
    """An application view (ATOMIC_REQUESTS is on): an order and its outbox message in one
    atomic() block; ``?fail=1`` raises after both were written."""
    from djshop.models import Payout

    with atomic_connection() as tx:
        Payout.objects.create(key=f"order:{name}", fence=0, run_id=0, pid=0)
        outbox.add(tx, "webhook", {"destination": "shop", "path": "/orders",
                                   "body": {"order": name}}, key=f"order:{name}")
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after writing")
    return HttpResponse("ok")


def checkout(request: HttpRequest, name: str) -> HttpResponse:
    """An order and its workflow start (``fulfil.start(..., conn=tx)``) in one atomic() block
    on Django's connection; ``?fail=1`` raises after both were written (ATOMIC_REQUESTS rolls
    the request back: no order, no workflow)."""
    from djshop.models import Payout

    from reliable_beat.workflows import WorkflowDefinition

    fulfil = WorkflowDefinition(name="djshop.fulfil", fn=lambda ctx, order: order)
    with atomic_connection() as tx:
        Payout.objects.create(key=f"checkout:{name}", fence=0, run_id=0, pid=0)
        fulfil.start(f"checkout:{name}", args=[name], conn=tx)
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after writing")
    return HttpResponse("ok")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("order/<str:name>/", order),
    path("checkout/<str:name>/", checkout),
]
