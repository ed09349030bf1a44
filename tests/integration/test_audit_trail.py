"""Audit completeness (issue 16): creating users, granting roles and superuser, deleting users,
and every settings change are recorded with who and the values before and after; refused and
failed operator actions are recorded too; secrets and passwords never appear."""

import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.urls import reverse

from console.staff import staff_ensure
from tasks.models import AuditEntry, QuotaOverride, Tenant, VendorChannel
from tests.support.forms import form_values

pytestmark = pytest.mark.django_db

PASSWORD = "a-Long-enough-passw0rd-for-django"


@pytest.fixture
def admin_client(client):
    user, password = staff_ensure(username="root-admin", role="admin", actor="test")
    assert client.login(username=user.username, password=password)
    return client


def last(action: str) -> AuditEntry:
    entry = AuditEntry.objects.filter(action=action).order_by("-id").first()
    assert entry is not None, f"no {action} entry; have {list(AuditEntry.objects.values_list('action', flat=True))}"
    return entry


def save(client, url: str, **changes):
    page = client.get(url)
    assert page.status_code == 200
    data = form_values(page.content.decode(), **changes)
    data.pop("_addanother", None), data.pop("_continue", None)
    return client.post(url, data)


def test_creating_a_user_granting_roles_and_superuser_and_deleting_it_are_audited(admin_client):
    answer = admin_client.post(reverse("admin:auth_user_add"), {
        "username": "new-operator", "password1": PASSWORD, "password2": PASSWORD, "usable_password": "true"})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    user = get_user_model().objects.get(username="new-operator")
    created = last("user_add")
    assert created.actor == "root-admin" and created.target_id == str(user.pk)
    assert created.detail["changes"]["username"] == {"before": None, "after": "new-operator"}
    assert PASSWORD not in json.dumps(created.detail)

    operator = Group.objects.get(name="operator")
    url = reverse("admin:auth_user_change", args=[user.pk])
    answer = save(admin_client, url, groups=[str(operator.pk)], is_superuser="on", is_staff="on")
    assert answer.status_code == 302, answer.content.decode()[:3000]
    changed = last("user_change").detail["changes"]
    assert changed["groups"] == {"before": [], "after": ["operator"]}
    assert changed["is_superuser"] == {"before": False, "after": True}

    answer = admin_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})
    assert answer.status_code == 302
    deleted = last("user_delete")
    assert deleted.target_id == str(user.pk) and deleted.detail["was"] == "new-operator"


def test_a_quota_change_records_its_values_before_and_after(admin_client):
    from tasks.services.tenancy import tenant_ensure

    tenant = tenant_ensure(name="acme")
    before = tenant.quota.max_running
    answer = save(admin_client, reverse("admin:tasks_tenant_change", args=[tenant.pk]), **{"quota-0-max_running": "7"})
    assert answer.status_code == 302, answer.content.decode()[:3000]
    entry = last("tenant_change")
    rows = entry.detail["rows"]
    assert rows == [{"row": "tenantquota", "id": str(tenant.quota.pk), "op": "change",
                     "changes": {"max_running": {"before": before, "after": 7}}}]


def test_a_quota_override_ending_before_it_starts_is_refused_on_the_form(admin_client):
    from tasks.services.tenancy import tenant_ensure

    tenant = tenant_ensure(name="acme")
    answer = save(admin_client, reverse("admin:tasks_tenant_change", args=[tenant.pk]), **{
        "quota_overrides-TOTAL_FORMS": "1", "quota_overrides-0-field": "max_running", "quota_overrides-0-value": "3",
        "quota_overrides-0-starts_at_0": "2026-12-02", "quota_overrides-0-starts_at_1": "10:00:00",
        "quota_overrides-0-ends_at_0": "2026-12-01", "quota_overrides-0-ends_at_1": "10:00:00",
        "quota_overrides-0-reason": "launch", "quota_overrides-0-tenant": str(tenant.pk)})
    assert answer.status_code == 200
    assert "An override must end after it starts." in answer.content.decode()
    assert not QuotaOverride.objects.exists() and not AuditEntry.objects.filter(action="tenant_change").exists()


def test_a_channel_change_records_values_but_never_a_secret(admin_client):
    url = reverse("admin:tasks_vendorchannel_change", args=["primary"])
    before = VendorChannel.objects.get(pk="primary").max_attempts
    answer = save(admin_client, url, max_attempts=str(before + 1), api_key="sk-replacement-9f8e7d6c5b4a")
    assert answer.status_code == 302, answer.content.decode()[:3000]
    changes = last("vendorchannel_change").detail["changes"]
    assert changes["max_attempts"] == {"before": before, "after": before + 1}
    assert changes["api_key"] == {"before": "(secret)", "after": "(replaced)"}
    assert "sk-replacement" not in json.dumps(list(AuditEntry.objects.values("detail")))


def test_failed_and_refused_operator_actions_are_audited(client, admin_client, api):
    from tasks.models import FileVersion, Quarantine
    from tasks.poc import files
    from tests.support.flows import route, submit_file

    task = route(submit_file(api, files.truncated_pdf(), name="x.pdf", kind="conversion", target="txt"))
    entry = Quarantine.objects.get(file=task.file)
    url = reverse("admin:quarantine_action", args=[entry.pk, "release"])
    admin_client.post(url, {"params": "not json"})
    failed = last("quarantine_release")
    assert failed.skipped == 1 and failed.detail["outcome"] == "refused" and "JSON object" in failed.detail["reason"]
    assert FileVersion.objects.get(pk=task.file_id).precheck_state == "quarantined"

    viewer, password = staff_ensure(username="viewer-user", role="viewer", actor="test")
    client.logout()
    assert client.login(username="viewer-user", password=password)
    assert client.post(url).status_code == 403
    denied = AuditEntry.objects.filter(actor="viewer-user", detail__outcome="denied").get()
    assert denied.skipped == 1 and "release" in denied.target_id


def test_tenant_settings_changes_name_each_field(admin_client):
    tenant = Tenant.objects.create(name="globex")
    answer = save(admin_client, reverse("admin:tasks_tenant_change", args=[tenant.pk]), result_retention_days="3")
    assert answer.status_code == 302, answer.content.decode()[:3000]
    changes = last("tenant_change").detail["changes"]
    assert changes["result_retention_days"]["after"] == 3


def test_a_channels_lane_rows_are_checked_on_save_and_their_change_audited(admin_client):
    url = reverse("admin:tasks_vendorchannel_change", args=["local"])
    for bad, says in (('{"heavy": 0}', "whole number of jobs"), ('{"hevy": 1}', "no lane named hevy"),
                      ('["heavy"]', "JSON object"), ('{"interactive+": 1, "+": 2}', "no lane named there")):
        answer = save(admin_client, url, lane_slots=bad)
        assert answer.status_code == 200 and says in answer.content.decode(), (bad, answer.content.decode()[:200])
    assert VendorChannel.objects.get(pk="local").lane_slots == {"interactive+batch": 2, "heavy": 1, "unknown-risk": 1}
    answer = save(admin_client, url, lane_slots='{"interactive+batch": 2, "heavy": 2, "unknown-risk": 1}')
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert VendorChannel.objects.get(pk="local").lane_slots["heavy"] == 2
    assert last("vendorchannel_change").detail["changes"]["lane_slots"]["after"]["heavy"] == 2


def test_a_lanes_execution_timeout_cannot_be_raised_past_what_its_workers_allow(admin_client, settings):
    from tasks.models import Lane

    url = reverse("admin:tasks_lane_change", args=["interactive"])
    bound = settings.LANE_EXECUTION_TIMEOUT_S["interactive"]
    answer = save(admin_client, url, execution_timeout_s=str(bound * 2))
    page = answer.content.decode()
    assert answer.status_code == 200 and f"SLUICE_LANE_EXECUTION_TIMEOUT_S=interactive={int(bound * 2)}" in page, page[:300]
    assert Lane.objects.get(pk="interactive").execution_timeout_s == bound
    answer = save(admin_client, url, execution_timeout_s=str(bound / 3))
    assert answer.status_code == 302 and Lane.objects.get(pk="interactive").execution_timeout_s == bound / 3
