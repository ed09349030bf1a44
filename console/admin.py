"""Model admins of the operator console."""

from django.contrib import admin

from console.admin_site import site
from tasks.models import Task


@admin.register(Task, site=site)
class TaskAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "state", "lane", "kind", "created_at")
    list_filter = ("state", "lane", "kind")
