"""The operator console: a custom Django admin site with extra views (console/pages.py)."""

from __future__ import annotations

from django.contrib import admin


class SluiceAdminSite(admin.AdminSite):
    site_header = "Sluice console"
    site_title = "Sluice console"
    index_title = "Operations"
    enable_nav_sidebar = False  # the grouped header navigation replaces it (room for the tables)

    def get_urls(self):
        from console.pages import build

        # Our pages first: the dashboard replaces the default index.
        return build(self) + super().get_urls()

    def each_context(self, request):
        from console.roles import role_of

        context = super().each_context(request)
        user = request.user
        context["sluice_role"] = role_of(user) if user.is_authenticated else None
        groups = [
            ("Work", [
                ("Dashboard", "admin:index", True),
                ("Tasks", "admin:tasks_task_changelist", user.has_perm("tasks.view_task")),
                ("Triage", "admin:triage", True),
                ("Quarantine", "admin:tasks_quarantine_changelist", user.has_perm("tasks.manage_quarantine")),
                ("Dead letters", "admin:tasks_deadletter_changelist", user.has_perm("tasks.manage_quarantine")),
                ("Lanes", "admin:tasks_lane_changelist", user.has_perm("tasks.view_lane")),
            ]),
            ("Vendors", [
                ("Channels", "admin:tasks_vendorchannel_changelist", user.has_perm("tasks.view_vendorchannel")),
                ("Billing", "admin:billing", True),
            ]),
            ("Tenants", [("Tenants", "admin:tasks_tenant_changelist", user.has_perm("tasks.view_tenant"))]),
            ("QA", [("POC", "admin:poc_list", True), ("Fake vendor", "admin:fakevendor", True)]),
            ("Audit", [("Audit", "admin:tasks_auditentry_changelist", user.has_perm("tasks.view_auditentry"))]),
        ]
        context["sluice_nav_groups"] = [(name, [(label, url) for label, url, ok in links if ok])
                                        for name, links in groups if any(ok for *_, ok in links)]
        return context


site = SluiceAdminSite(name="admin")
