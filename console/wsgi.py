"""WSGI entry point (gunicorn console.wsgi)."""

import os

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
application = get_wsgi_application()

if not settings.DEBUG and settings.SECRET_KEY == settings.DEV_SECRET_KEY:
    # With the published key anyone could mint signed result links and sessions.
    raise ImproperlyConfigured(
        "Refusing to serve with the published development SECRET_KEY while SLUICE_DEBUG is off: set "
        "SLUICE_SECRET_KEY (the same on every process), or run `make install`, which writes a key for this "
        f"installation to {settings.SECRET_KEY_FILE}."
    )

# The URLconf (the console's and the API's views and schemas) is loaded as a worker boots, not by
# its first request, which otherwise waits a second or so for the imports.
from django.urls import get_resolver  # noqa: E402

get_resolver().url_patterns  # noqa: B018
