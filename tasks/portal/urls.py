from django.contrib.auth import views as auth_views
from django.urls import path
from django.views.generic import RedirectView

from tasks.portal import views

app_name = "portal"

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="portal:task_list", permanent=False)),
    path("login/", auth_views.LoginView.as_view(template_name="portal/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="portal:login"), name="logout"),
    path("tasks/", views.task_list, name="task_list"),
    path("tasks/states.json", views.task_states, name="task_states"),
    path("tasks/new/", views.upload, name="upload"),
    path("tasks/<str:task_id>/", views.task_detail, name="task_detail"),
    path("tasks/<str:task_id>/cancel/", views.task_cancel_view, name="task_cancel"),
    path("tasks/<str:task_id>/download/", views.task_download, name="task_download"),
]
