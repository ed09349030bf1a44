"""Vendor secrets are write-only (issue 16): no console role reads them, admins see whether one is
set and its last 4 characters, an empty field keeps the stored value, and the table holds them
encrypted."""

import pytest
from django.db import connection
from django.urls import reverse

from console.admin import VendorChannelForm
from console.staff import staff_ensure
from tasks.models import VendorChannel

pytestmark = pytest.mark.django_db

API_KEY = "sk-live-4f9a1c0d7e2b8a65QWERTY"
WEBHOOK_SECRET = "whsec-93be1f0a6c2d47e8ZXCV"


@pytest.fixture
def channel(db):
    channel = VendorChannel.objects.get(name="primary")
    channel.api_key, channel.webhook_secret = API_KEY, WEBHOOK_SECRET
    channel.save()
    return channel


def page_as(client, role: str, url: str) -> str:
    user, password = staff_ensure(username=f"{role}-user", role=role, actor="test")
    assert client.login(username=user.username, password=password)
    answer = client.get(url)
    assert answer.status_code == 200, answer.status_code
    return answer.content.decode()


@pytest.mark.parametrize("role", ["viewer", "operator", "qa", "admin"])
def test_no_role_reads_a_channel_secret(client, channel, role):
    for url in (reverse("admin:tasks_vendorchannel_change", args=["primary"]),
                reverse("admin:tasks_vendorchannel_changelist"), reverse("admin:index")):
        html = page_as(client, role, url)
        for secret in (API_KEY, WEBHOOK_SECRET, API_KEY[:-4], WEBHOOK_SECRET[:-4]):
            assert secret not in html, (role, url)


def test_an_admin_sees_that_a_secret_is_set_and_its_last_four_characters(client, channel):
    html = page_as(client, "admin", reverse("admin:tasks_vendorchannel_change", args=["primary"]))
    assert f"set (…{API_KEY[-4:]})" in html and f"set (…{WEBHOOK_SECRET[-4:]})" in html
    assert 'name="api_key"' in html and 'value="' + API_KEY not in html


def test_a_viewer_sees_only_whether_each_secret_is_set(client, channel):
    html = page_as(client, "viewer", reverse("admin:tasks_vendorchannel_change", args=["primary"]))
    assert "api key: set" in html and "webhook secret: set" in html
    assert API_KEY[-4:] not in html


def form_data(channel, **changes):
    form = VendorChannelForm(instance=channel)
    data = {name: form.initial.get(name) for name in form.fields if name not in ("api_key", "webhook_secret")}
    data = {k: v for k, v in data.items() if v is not None}
    for name in ("kinds", "capability_overrides"):
        if name in data and not isinstance(data[name], str):
            import json

            data[name] = json.dumps(data[name])
    return {**data, "api_key": "", "webhook_secret": "", **changes}


def test_an_empty_secret_field_keeps_the_stored_value_and_a_new_one_replaces_it(channel):
    form = VendorChannelForm(form_data(channel), instance=channel)
    assert form.is_valid(), form.errors
    form.save()
    kept = VendorChannel.objects.get(name="primary")
    assert (kept.api_key, kept.webhook_secret) == (API_KEY, WEBHOOK_SECRET)

    form = VendorChannelForm(form_data(kept, api_key="sk-rotated-0000111122223333"), instance=kept)
    assert form.is_valid(), form.errors
    form.save()
    assert VendorChannel.objects.get(name="primary").api_key == "sk-rotated-0000111122223333"


def test_secrets_are_stored_encrypted(channel):
    with connection.cursor() as cursor:
        cursor.execute("SELECT api_key, webhook_secret FROM tasks_vendorchannel WHERE name = %s", ["primary"])
        stored = cursor.fetchone()
    assert all(value.startswith("fernet:") for value in stored)
    assert API_KEY not in stored[0] and WEBHOOK_SECRET not in stored[1]
    assert VendorChannel.objects.get(name="primary").api_key == API_KEY


def test_a_channel_base_url_set_in_the_console_is_validated(channel, settings):
    settings.VENDOR_ALLOW_PRIVATE = False
    form = VendorChannelForm(form_data(channel, base_url="http://127.0.0.1:9100/primary"), instance=channel)
    assert not form.is_valid()
    assert "private, loopback or reserved" in str(form.errors["base_url"])


def test_rotation_re_encrypts_with_the_new_key_and_the_old_key_can_then_go(channel, settings):
    from cryptography.fernet import Fernet
    from django.core.management import call_command

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.SECRETS_KEYS = old
    channel.save()  # sealed with the old key
    settings.SECRETS_KEYS = f"{new},{old}"
    call_command("secrets_rotate")
    settings.SECRETS_KEYS = new
    rotated = VendorChannel.objects.get(name="primary")
    assert (rotated.api_key, rotated.webhook_secret) == (API_KEY, WEBHOOK_SECRET)


def test_rotation_without_the_old_key_stops_and_changes_nothing(channel, settings):
    from cryptography.fernet import Fernet
    from django.core.management import call_command
    from django.core.management.base import CommandError

    sealed_with = Fernet.generate_key().decode()
    settings.SECRETS_KEYS = sealed_with
    channel.save()
    settings.SECRETS_KEYS = Fernet.generate_key().decode()  # the key it was sealed with is gone
    with pytest.raises(CommandError, match="put the old key back"):
        call_command("secrets_rotate")
    settings.SECRETS_KEYS = sealed_with
    assert VendorChannel.objects.get(name="primary").api_key == API_KEY
