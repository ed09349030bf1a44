"""Sluice settings. Every knob comes from the environment (documented in README.md)."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from console.env import env, one_of, parse_mapping, positive_float_at_most

BASE_DIR = Path(__file__).resolve().parent.parent
# pytest sets PYTEST_VERSION: tests (and the processes they start) keep their data apart.
TESTING = bool(os.environ.get("PYTEST_VERSION"))
DATA_DIR = Path(env("SLUICE_DATA_DIR", str(BASE_DIR / "var" / ("test" if TESTING else "")))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

# The key signs sessions, result links and queue payloads: every process of an installation must
# share it. From the environment, else from the install's key file (`make run` and `make install`
# write one), else the published development key, with which the web process refuses to serve
# unless debugging (console/wsgi.py).
DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me-in-production"
SECRET_KEY_FILE = Path(env("SLUICE_SECRET_KEY_FILE", str(BASE_DIR / "var" / "secret_key")))
SECRET_KEY = env("SLUICE_SECRET_KEY", "") or (
    SECRET_KEY_FILE.read_text().strip() if SECRET_KEY_FILE.is_file() else "") or DEV_SECRET_KEY
DEBUG = env("SLUICE_DEBUG", False)
ALLOWED_HOSTS = env("SLUICE_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env("SLUICE_CSRF_TRUSTED_ORIGINS", ["http://127.0.0.1:8000", "http://localhost:8000"])

INSTALLED_APPS = [
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_q",
    "tasks",
    "fakevendor",
    "console.apps.ConsoleConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "tasks.api.bodies.ChunkedBodies",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "tasks.api.problems.ProblemJsonMiddleware",
    "console.inputs.ConsoleBadInput",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database: embedded SQLite by default, PostgreSQL when DATABASE_URL is set -------------
DATABASE_URL = env("DATABASE_URL", "")
# Each process (and web thread) keeps its connection between requests and steps instead of opening
# one per step: a new PostgreSQL connection forks a backend, a new SQLite one runs its pragmas, and
# django-q2's ORM broker asks for a fresh one on every queue operation. A connection that broke
# (the database restarted, the host was cut off) is checked before reuse and replaced.
CONN_MAX_AGE = env("SLUICE_DB_CONN_MAX_AGE", 300)
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=CONN_MAX_AGE, conn_health_checks=True)}
    DATABASES["default"].setdefault("TEST", {})
    DATABASES["default"]["TEST"]["NAME"] = env("SLUICE_TEST_DATABASE_NAME", "sluice_test")
    # A kept connection whose peer vanished (a partition, a failover) must fail in seconds, not
    # after the kernel's minutes of retransmits: libpq's connect timeout, TCP keepalives on an idle
    # connection, and a bound on unacknowledged data while a query is sent.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3,
         "keepalives_count": 3, "tcp_user_timeout": 15000, **DATABASES["default"].get("OPTIONS", {})})
    # Statements a connection runs again are prepared on the server (parsed and planned once):
    # the same few statements run for every task, and planning them again each time was most of
    # the database server's CPU per task. Off for a pooler that cannot keep a connection's
    # prepared statements (PgBouncer in transaction mode before 1.21).
    if env("SLUICE_DB_PREPARED_STATEMENTS", True):
        DATABASES["default"]["OPTIONS"].update(server_side_binding=True, prepare_threshold=2)
else:
    # WAL + IMMEDIATE transactions + a busy timeout on every connection: without them, writes
    # from several worker processes fail with "database is locked" (shared/notes/django-q2.md).
    # Django's backend with the writers queued on a lock file (tasks/sqlite_backend/base.py).
    DATABASES = {
        "default": {
            "ENGINE": "tasks.sqlite_backend",
            "NAME": env("SLUICE_DATABASE_PATH", str(DATA_DIR / "sluice.sqlite3")),
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not :memory:, so forked worker processes see the test database.
            "TEST": {"NAME": str(DATA_DIR / "test-sluice.sqlite3")},
            "CONN_MAX_AGE": CONN_MAX_AGE,
            "CONN_HEALTH_CHECKS": True,
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Broker and cache: django-q2's ORM broker by default, Redis when REDIS_URL is set -------
REDIS_URL = env("REDIS_URL", "")
if REDIS_URL and "socket_timeout" not in REDIS_URL:
    # A host cut from Redis must get an error in seconds, not wait on a silent connection for ever
    # (the broker's blocking reads wait at most 1 s, well inside these).
    REDIS_URL += ("&" if "?" in REDIS_URL else "?") + "socket_connect_timeout=3&socket_timeout=10"
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": env("SLUICE_Q_NAME", "sluice-test" if TESTING else "sluice"),
        }
    }
else:
    # Shared between processes on one host, so qinfo and the console see every cluster.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(DATA_DIR / "cache"),
        }
    }

# Multiplies every interval in the system (backoff, polls, leases, deadlines, breaker waits).
TIME_SCALE = env("SLUICE_TIME_SCALE", 1.0, cast=positive_float_at_most(10))
# PostgreSQL never learns that a client behind a partition (or frozen) is gone: its session, open
# inside a transaction, would keep every lock it holds (the admission lock: no host admits again)
# until the client's close reaches the server, which may be never. The server ends a session idle
# inside a transaction this long (nominal seconds, floor in real seconds; 0: never). Sluice's own
# transactions make no network call, so only a vanished client is ever idle that long; its
# transaction rolls back. The server also probes idle connections, so dead ones are closed.
DB_IDLE_IN_TRANSACTION_S = env("SLUICE_DB_IDLE_IN_TRANSACTION_S", 60.0)
DB_IDLE_IN_TRANSACTION_FLOOR_S = 10.0
if DATABASE_URL:
    _session = ["-c tcp_keepalives_idle=30", "-c tcp_keepalives_interval=10", "-c tcp_keepalives_count=3"]
    if DB_IDLE_IN_TRANSACTION_S > 0:
        _idle_ms = int(max(DB_IDLE_IN_TRANSACTION_S * TIME_SCALE, DB_IDLE_IN_TRANSACTION_FLOOR_S) * 1000)
        _session.append(f"-c idle_in_transaction_session_timeout={_idle_ms}")
    # Options given in DATABASE_URL (?options=...) come last, so they win.
    _options = DATABASES["default"]["OPTIONS"]
    _options["options"] = " ".join([*_session, *([_options["options"]] if _options.get("options") else [])])

LANES = ("interactive", "batch", "heavy", "unknown-risk")
LANE_WORKERS = {"interactive": 2, "batch": 1, "heavy": 1, "unknown-risk": 1}
LANE_WORKERS.update(env("SLUICE_LANE_WORKERS", {}, cast=parse_mapping))
# CPU priority of each lane's cluster (Unix nice increments): on a shared host the best-effort
# lanes yield the processor to interactive work instead of competing with it as equals.
LANE_NICE = {"interactive": 0, "batch": 5, "heavy": 10, "unknown-risk": 10}
LANE_NICE.update(env("SLUICE_LANE_NICE", {}, cast=parse_mapping))
# The longest single attempt per lane (nominal seconds): the lanes' default execution timeouts.
# Each lane's cluster kills a step that outlives its lane's bound (below), so a lane's execution
# timeout may be lowered in the console but raised only here (e.g. "interactive=1800") and a restart.
LANE_EXECUTION_TIMEOUT_S = {"interactive": 900, "batch": 3600, "heavy": 4 * 3600, "unknown-risk": 3600}
LANE_EXECUTION_TIMEOUT_S.update(env("SLUICE_LANE_EXECUTION_TIMEOUT_S", {}, cast=parse_mapping))
# A step that outlives its attempt by this much is killed by django-q2 (nominal, floor in real s).
STEP_GRACE_S = env("SLUICE_STEP_GRACE_S", 60.0)
STEP_GRACE_FLOOR_S = 5.0
# The django-q2 timeout of a lane bounds one message (a step, or a pre-check and the start that may
# follow it): the lane's execution timeout plus the grace, in real seconds. Each step is sent with
# the timeout its lane has now (an operator may shorten it); the broker's retry must exceed both.
LANE_STEP_TIMEOUT_S = {
    lane: int(seconds * TIME_SCALE + max(STEP_GRACE_S * TIME_SCALE, STEP_GRACE_FLOOR_S)) + 1
    for lane, seconds in LANE_EXECUTION_TIMEOUT_S.items()
}
CONTROL_WORKERS = env("SLUICE_CONTROL_WORKERS", 2)
# A stopping cluster hands its steps back and is gone within this many real seconds.
SHUTDOWN_S = env("SLUICE_SHUTDOWN_S", 30.0)

_broker = {"redis": REDIS_URL} if REDIS_URL else {"orm": "default", "broker_class": "tasks.brokers.Orm"}
# django-q2's own log lines ("Enqueued", "Processed", a cluster's start), apart from Sluice's.
Q_LOG_LEVEL = env("SLUICE_Q_LOG_LEVEL", "WARNING", cast=one_of("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
Q_CLUSTER = {
    "name": env("SLUICE_Q_NAME", "sluice-test" if TESTING else "sluice"),
    "workers": CONTROL_WORKERS,
    "timeout": 900,
    "retry": 960,
    # The task table is the truth: a failed step is not re-run by the broker; sweeps recover.
    "max_attempts": 1,
    "ack_failures": True,
    "save_limit": -1,
    "queue_limit": CONTROL_WORKERS * 2,
    "catch_up": False,
    "poll": 0.1,
    "label": "Queue (django-q2)",
    "log_level": Q_LOG_LEVEL,
    **_broker,
    "ALT_CLUSTERS": {
        lane: {
            "workers": LANE_WORKERS[lane],
            "timeout": LANE_STEP_TIMEOUT_S[lane],
            "retry": LANE_STEP_TIMEOUT_S[lane] + 60,
            # No prefetching beyond what the workers can run (article 001).
            "queue_limit": LANE_WORKERS[lane],
            "scheduler": False,
        }
        for lane in LANES
    },
}

# --- Sluice behaviour --------------------------------------------------------------------
MAX_UPLOAD_BYTES = env("SLUICE_MAX_UPLOAD_BYTES", 2 * 1024**3)
FILES_DIR = DATA_DIR / "files"
RESULTS_DIR = DATA_DIR / "results"
# Object storage for stored files and results (tasks/storage.py): "" keeps them under
# SLUICE_DATA_DIR; "s3://bucket/prefix" puts them in an S3-compatible bucket, reached at
# SLUICE_S3_ENDPOINT_URL (empty: AWS) in SLUICE_S3_REGION with the credentials of boto3's own
# chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, an instance role).
STORAGE_URL = env("SLUICE_STORAGE_URL", "")
S3_ENDPOINT_URL = env("SLUICE_S3_ENDPOINT_URL", "")
S3_REGION = env("SLUICE_S3_REGION", "us-east-1")
DISPATCH_TICK_S = env("SLUICE_DISPATCH_TICK_S", 0.2)
# Deadlines, the watchdog, probes, notifications and housekeeping: at most this often (real s).
DISPATCH_FULL_TICK_S = env("SLUICE_DISPATCH_FULL_TICK_S", 0.25)
# A step's lease (nominal seconds, scaled) and its floor in real seconds.
LEASE_S = env("SLUICE_LEASE_S", 30.0)
LEASE_FLOOR_S = env("SLUICE_LEASE_FLOOR_S", 3.0)
CALLBACK_ALLOW_PRIVATE = env("SLUICE_CALLBACK_ALLOW_PRIVATE", False)
# Vendor base URLs set in the console may point at private addresses (the bundled fake vendor is
# on loopback); set 0 where vendors are only ever public.
VENDOR_ALLOW_PRIVATE = env("SLUICE_VENDOR_ALLOW_PRIVATE", True)
SIGNED_URL_TTL_S = env("SLUICE_SIGNED_URL_TTL_S", 900)
# The local conversion engine (LibreOffice + poppler): "auto" enables its channel where both are
# installed, "off" never. Budgets per lane for each converter process (tasks/engine/runner.py).
LOCAL_ENGINE = env("SLUICE_LOCAL_ENGINE", "auto", cast=one_of("auto", "off"))
ENGINE_BUDGETS = {
    "default": {"cpu_s": env("SLUICE_ENGINE_CPU_S", 60), "memory_mb": env("SLUICE_ENGINE_MEMORY_MB", 3072),
                "output_mb": env("SLUICE_ENGINE_OUTPUT_MB", 200), "wall_s": env("SLUICE_ENGINE_WALL_S", 120)},
    "heavy": {"cpu_s": 240, "wall_s": 480, "memory_mb": 4096},
    "unknown-risk": {"cpu_s": 30, "wall_s": 60},
}
# Converters at once per lane (budget rows held across processes, like a vendor's job slots):
# normal documents share two, heavy and risky ones have one each, so neither starves the other.
ENGINE_LANE_SLOTS = {"interactive+batch": 2, "heavy": 1, "unknown-risk": 1}
ENGINE_SLOTS = env("SLUICE_ENGINE_SLOTS", sum(ENGINE_LANE_SLOTS.values()))  # converters at once on the local channel
# Warm converters per lane (running LibreOffice processes reused for PDF exports; 0: always cold).
# Risky documents always get a fresh process.
ENGINE_WARM_POOL = {"interactive": 2, "batch": 2, "heavy": 1, "unknown-risk": 0}
ENGINE_WARM_RECYCLE_AFTER = env("SLUICE_ENGINE_WARM_RECYCLE_AFTER", 50)  # conversions before an instance is replaced
ENGINE_WARM_IDLE_S = env("SLUICE_ENGINE_WARM_IDLE_S", 120.0)  # an idle instance ends after this
# Test documents may stand for a looping, allocating or crashing document by a marker (tests only).
ENGINE_TEST_MARKERS = env("SLUICE_ENGINE_TEST_MARKERS", False)
PRECHECK_CPU_S = env("SLUICE_PRECHECK_CPU_S", 10)
PRECHECK_MEMORY_MB = env("SLUICE_PRECHECK_MEMORY_MB", 512)
PRECHECK_WALL_S = env("SLUICE_PRECHECK_WALL_S", 20.0)
PRECHECK_PLUGINS = env("SLUICE_PRECHECK_PLUGINS", [])
VENDOR_PRIMARY_URL = env("SLUICE_VENDOR_PRIMARY_URL", "http://127.0.0.1:9100/primary")
VENDOR_FALLBACK_URL = env("SLUICE_VENDOR_FALLBACK_URL", "http://127.0.0.1:9100/fallback")
# The vendor dialect of each channel created on first migrate (sluice | assemblyai).
VENDOR_PRIMARY_DIALECT = env("SLUICE_VENDOR_PRIMARY_DIALECT", "sluice", cast=one_of("sluice", "assemblyai"))
VENDOR_FALLBACK_DIALECT = env("SLUICE_VENDOR_FALLBACK_DIALECT", "sluice", cast=one_of("sluice", "assemblyai"))
VENDOR_API_KEY = env("SLUICE_VENDOR_API_KEY", "dev-vendor-key")
# Fernet keys for secrets at rest, comma-separated, the first encrypting (tasks/secrets.py).
SECRETS_KEYS = env("SLUICE_SECRETS_KEYS", "")
VENDOR_WEBHOOK_SECRET = env("SLUICE_VENDOR_WEBHOOK_SECRET", "dev-webhook-secret")
FAKEVENDOR_URL = env("FAKEVENDOR_URL", "http://127.0.0.1:9100")
POC_LIVE_URL = env("SLUICE_LIVE_URL", "http://127.0.0.1:8000")
# Where vendors can reach this installation; when set, jobs ask the vendor for signed callbacks
# (they shorten the wait for the next poll; polling stays the source of truth).
PUBLIC_URL = env("SLUICE_PUBLIC_URL", "")
FAKEVENDOR_ADMIN_TOKEN = env("FAKEVENDOR_ADMIN_TOKEN", "dev-admin-token")
# A deliberately unsafe experiment for QA: resend after an ambiguous failure without reconciling
# (what naive clients do). The POC scenarios must then fail. Never set it in production.
UNSAFE_SKIP_RECONCILIATION = env("SLUICE_UNSAFE_SKIP_RECONCILIATION", False)
BENCH_VIEWS = env("SLUICE_BENCH_VIEWS", False)
LOG_FILE = env("SLUICE_LOG_FILE", "")
LOG_STDERR = env("SLUICE_LOG_STDERR", True)

# --- Django plumbing ---------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "portal:login"
LOGIN_REDIRECT_URL = "portal:task_list"
FILE_UPLOAD_TEMP_DIR = str(DATA_DIR / "tmp")
Path(FILE_UPLOAD_TEMP_DIR).mkdir(parents=True, exist_ok=True)
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
# Multipart file names are labels only: the temporary file gets a short safe name of its own.
FILE_UPLOAD_HANDLERS = ["tasks.api.bodies.LabelledMemoryUpload", "tasks.api.bodies.LabelledTemporaryUpload"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "tasks.observability.JsonFormatter"}},
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "json"},
        **(
            {"file": {"class": "logging.FileHandler", "filename": LOG_FILE, "formatter": "json"}}
            if LOG_FILE
            else {}
        ),
    },
    "root": {
        "handlers": [*(["stderr"] if LOG_STDERR else []), *(["file"] if LOG_FILE else [])],
        "level": env("SLUICE_LOG_LEVEL", "INFO"),
    },
    "loggers": {
        # django-q2 sets its logger's level itself only when no handler would take its lines;
        # ours do (the root's), so its level is set here.
        "django-q": {"level": Q_LOG_LEVEL},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}
