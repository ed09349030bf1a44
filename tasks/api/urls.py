from django.urls import path

from tasks.api import views

app_name = "api"

urlpatterns = [
    path("files", views.files, name="files"),
    path("files/<str:file_id>", views.file_detail, name="file"),
    path("tasks", views.tasks, name="tasks"),
    path("tasks/<str:task_id>", views.task_detail, name="task"),
    path("tasks/<str:task_id>/events", views.task_events, name="task_events"),
    path("tasks/<str:task_id>/cancel", views.task_cancel_view, name="task_cancel"),
    path("tasks/<str:task_id>/result", views.task_result, name="task_result"),
    path("tasks/<str:task_id>/result-link", views.task_result_link, name="task_result_link"),
    path("results/<str:token>", views.signed_result, name="signed_result"),
    path("vendor-callbacks/<str:channel_name>", views.vendor_callback, name="vendor_callback"),
    path("openapi.json", views.openapi, name="openapi"),
]
