"""References the benchmarks compare Sluice against, measured in the same run on the same machine.

- `bare_view`: a Django view in the same server setup that inserts one row (mounted at
  /bench/bare only when SLUICE_BENCH_VIEWS=1).
- `noop`: a django-q2 task that does nothing (the baseline of the queue); the benchmark times how
  long the broker takes to drain a batch of them.
- `ran`: a django-q2 task that leaves a file behind, so the benchmark knows a cluster has run it
  (a lane's message leaves its queue when it is taken, before it runs).
"""

from __future__ import annotations

from pathlib import Path

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def bare_view(request: HttpRequest) -> JsonResponse:
    from console.models import BenchmarkRow

    row = BenchmarkRow.objects.create(payload=request.headers.get("Idempotency-Key", "")[:100])
    return JsonResponse({"id": row.pk}, status=202)


def noop(marker: int) -> None:
    return None


def ran(marker: str) -> None:
    Path(marker).touch()
