from django.urls import path

from console import admin  # noqa: F401 - registers the console's model admins
from console.admin_site import site

urlpatterns = [path("", site.urls)]
