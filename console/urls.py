from django.conf import settings
from django.urls import include, path

from console import views
from tasks.api.views import api, openapi

urlpatterns = [
    path("api/v1/openapi.json", openapi, name="openapi"),
    path("api/v1/", api.urls),
    path("console/", include("console.site_urls")),
    path("metrics", views.metrics, name="metrics"),
    path("healthz", views.healthz, name="healthz"),
    path("", include("tasks.portal.urls")),
]

if settings.BENCH_VIEWS:
    from tasks.bench.reference import bare_view

    urlpatterns.insert(0, path("bench/bare", bare_view, name="bench_bare"))
