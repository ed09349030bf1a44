"""The operator console: a custom Django admin site with extra views."""

from __future__ import annotations

from django.contrib import admin


class SluiceAdminSite(admin.AdminSite):
    site_header = "Sluice console"
    site_title = "Sluice console"
    index_title = "Operations"


site = SluiceAdminSite(name="admin")
