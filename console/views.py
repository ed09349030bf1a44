"""Health and Prometheus metrics (read from the database, so every process's work is counted)."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from console.metrics import SluiceCollector


def healthz(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"ok": True})


def metrics(request: HttpRequest) -> HttpResponse:
    registry = CollectorRegistry()
    registry.register(SluiceCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
