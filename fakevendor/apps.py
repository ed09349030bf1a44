from django.apps import AppConfig


class FakeVendorConfig(AppConfig):
    name = "fakevendor"
    verbose_name = "Fake vendor"
