"""Hangar's one settings module, read from the environment.

Every service has an embedded default so a bare ``hangar up`` runs: SQLite (WAL) and a
Redis on a unix socket under ``HANGAR_DATA_DIR``. ``DATABASE_URL`` and ``REDIS_URL`` switch to
real servers.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str) -> str:
    return os.environ.get(name) or default


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum:g}, got {raw!r}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {raw!r}")


def env_pem_file(name: str) -> str:
    """The path of a PEM bundle of certificates, or "" when unset; an unreadable file, or one
    that holds no certificate, fails loudly."""
    raw = os.environ.get(name)
    if not raw:
        return ""
    from runtime.launchers.agent.ca import read_bundle

    path = str(Path(raw).expanduser().absolute())
    try:
        read_bundle(path)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None
    return path


def env_launcher_classes(name: str) -> dict[str, str]:
    """``name=module:Class,…``: launchers registered without packaging."""
    from runtime.launchers.registry import parse_classes

    try:
        return parse_classes(os.environ.get(name, ""))
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None


def env_launcher_config(name: str, defaults: dict[str, dict]) -> dict[str, dict]:
    """Each launcher's settings block: ``defaults``, each block updated from the JSON object of
    objects in ``name`` ({"gvisor": {"platform": "kvm"}})."""
    raw = os.environ.get(name)
    if not raw:
        return defaults
    try:
        given = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a JSON object, got {raw!r} ({exc})") from None
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        raise ImproperlyConfigured(f'{name} must map launcher names to objects, e.g. {{"gvisor": {{...}}}}')
    return {k: {**defaults.get(k, {}), **given.get(k, {})} for k in {*defaults, *given}}


def check_launchers(classes: dict[str, str], named: list[str], default: str) -> None:
    """Every launcher named in the settings is one this install has."""
    from runtime.launchers.registry import launcher_names

    known = sorted({*launcher_names(), *classes})
    for setting, names in (("HANGAR_LAUNCHERS", named), ("HANGAR_DEFAULT_RUNTIME", [default])):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ImproperlyConfigured(
                f"{setting} names {', '.join(unknown)}, which this install has no launcher for; it has: "
                f"{', '.join(known)} (HANGAR_LAUNCHER_CLASSES registers more)"
            )


def database_from_url(url: str, data_dir: Path) -> dict:
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(data_dir / "hangar.sqlite3"),
            # Several processes (server, workers, beat) write: WAL lets readers and one writer
            # overlap, IMMEDIATE takes the write lock up front instead of failing on upgrade.
            # Keep connections: opening one costs the PRAGMAs below on every request otherwise.
            "CONN_MAX_AGE": env_int("HANGAR_DB_CONN_MAX_AGE", 600),
            "OPTIONS": {
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
            },
        }
    parsed = urlparse(url)
    if parsed.scheme in ("postgres", "postgresql"):
        options = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parsed.path.lstrip("/")) or "hangar",
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": env_int("HANGAR_DB_CONN_MAX_AGE", 60),
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }
    if parsed.scheme == "sqlite":
        return {**database_from_url("", data_dir), "NAME": parsed.path}
    raise ImproperlyConfigured(
        f"DATABASE_URL must be postgres://… or sqlite:///…, got scheme {parsed.scheme!r}"
    )


BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("HANGAR_DATA_DIR", "~/.local/share/hangar")).expanduser().resolve()

SECRET_KEY = os.environ.get("HANGAR_SECRET_KEY", "")
if not SECRET_KEY:
    # A per-install key kept next to the data, so sessions survive restarts.
    _key_file = DATA_DIR / "secret_key"
    try:
        SECRET_KEY = _key_file.read_text().strip()
    except OSError:
        import secrets as _secrets

        SECRET_KEY = _secrets.token_urlsafe(50)
        try:
            DATA_DIR.mkdir(parents=True, exist_ok=True)
            _key_file.write_text(SECRET_KEY)
            _key_file.chmod(0o600)
        except OSError:
            pass

DEBUG = env_bool("HANGAR_DEBUG", False)
ALLOWED_HOSTS = [h.strip() for h in env_str("HANGAR_ALLOWED_HOSTS", "*").split(",") if h.strip()]
CSRF_TRUSTED_ORIGINS = [h.strip() for h in env_str("HANGAR_CSRF_TRUSTED_ORIGINS", "").split(",") if h.strip()]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "runtime",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "dashboard.middleware.AuditActorMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
# What /api/ runs through (see dashboard/asgi.py): bearer tokens, no cookies.
HANGAR_API_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "dashboard.middleware.AuditActorMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Passwords are checked through a throttle (dashboard/signin.py): the sign-in page, the admin's
# and anything else that signs in with one.
AUTHENTICATION_BACKENDS = ["dashboard.signin.ThrottledModelBackend"]

ROOT_URLCONF = "dashboard.urls"
ASGI_APPLICATION = "dashboard.asgi.application"
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
            ]
        },
    }
]

DATABASE_URL = env_str("DATABASE_URL", "")
DATABASES = {"default": database_from_url(DATABASE_URL, DATA_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL", f"unix://{DATA_DIR / 'redis.sock'}?db=0")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "runtime.services.redis_layer.RedisLayer",
        # Flow control keeps a follower's backlog to a few messages; the capacity only has to
        # absorb bursts (a full channel drops messages, and followers re-sync by offset).
        # The socket timeout must outlast channels_redis's 5 s blocking reads (redis-py's
        # default is 5 s too, which would break every idle socket).
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
            "capacity": 1000,
            "expiry": 60,
            "prefix": "hangar:ws:",
        },
    }
}


def celery_redis_url(url: str) -> str:
    # redis-py spells a unix socket unix:///path; kombu and Celery's backend spell it redis+socket://.
    if url.startswith("unix://"):
        return "redis+socket://" + urlparse(url).path
    return url


CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", celery_redis_url(REDIS_URL))
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", celery_redis_url(REDIS_URL))
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("HANGAR_TASK_TIME_LIMIT", 900)
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_TASK_TIME_LIMIT - 30
CELERY_RESULT_EXPIRES = 3600
# Only the node calls (runtime.tasks.node_op, volume_op) are waited on for an answer; every other
# task's result would be one more Redis write per task that nobody reads.
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
HANGAR_NODE_HEARTBEAT_S = env_float("HANGAR_NODE_HEARTBEAT_S", 5.0)
CELERY_BEAT_SCHEDULE = {
    "nodes-tick": {"task": "runtime.tasks.nodes_tick", "schedule": env_float("HANGAR_NODE_TICK_S", 10.0)},
    # Heartbeats asked for and read this often: a dead node is lost within the threshold.
    "nodes-heartbeat": {"task": "runtime.tasks.nodes_heartbeat", "schedule": HANGAR_NODE_HEARTBEAT_S},
    "sandboxes-reap": {
        "task": "runtime.tasks.sandboxes_reap",
        "schedule": env_float("HANGAR_REAP_TICK_S", 5.0),
    },
    "usage-meter": {"task": "runtime.tasks.usage_meter", "schedule": env_float("HANGAR_METER_TICK_S", 60.0)},
    "sandboxes-prune": {"task": "runtime.tasks.sandboxes_prune", "schedule": 3600.0},
    "traces-prune": {"task": "runtime.tasks.traces_prune", "schedule": 3600.0},
}

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/sandboxes/"
LOGOUT_REDIRECT_URL = "/login/"
USE_TZ = True
TIME_ZONE = "UTC"

# Hangar itself
HANGAR_NODE_NAME = env_str("HANGAR_NODE_NAME", socket.gethostname().split(".")[0] or "local")
HANGAR_RUNSC = env_str("HANGAR_RUNSC", "")  # empty: runtime.launchers.gvisor.runsc.default_runsc()
HANGAR_RUNSC_PLATFORM = env_str("HANGAR_RUNSC_PLATFORM", "ptrace")  # see gvisor.runsc.DEFAULT_PLATFORM
HANGAR_IMAGES_DIR = Path(env_str("HANGAR_IMAGES_DIR", str(DATA_DIR / "images")))
HANGAR_RUNTIME_DIR = Path(env_str("HANGAR_RUNTIME_DIR", str(DATA_DIR / "runtime")))
HANGAR_VOLUMES_DIR = Path(env_str("HANGAR_VOLUMES_DIR", str(DATA_DIR / "volumes")))
HANGAR_POOL_MAX_SIZE = env_int("HANGAR_POOL_MAX_SIZE", 20, minimum=1)
# After a claim that leaves the pool a member ready, its refill waits this long (0: at once), so
# booting the replacement does not take the CPU from the caller's first commands.
HANGAR_POOL_REFILL_DELAY_S = env_float("HANGAR_POOL_REFILL_DELAY_S", 1.0, minimum=0)
HANGAR_VOLUME_MAX_MB = env_int("HANGAR_VOLUME_MAX_MB", 100 * 1024, minimum=16)
HANGAR_NODE_CPU = env_float("HANGAR_NODE_CPU", float(os.cpu_count() or 1))
HANGAR_NODE_MEMORY_MB = env_int("HANGAR_NODE_MEMORY_MB", 0, minimum=0)  # 0: read from /proc/meminfo
HANGAR_CPU_OVERCOMMIT = env_float("HANGAR_CPU_OVERCOMMIT", 4.0)
HANGAR_MEMORY_OVERCOMMIT = env_float("HANGAR_MEMORY_OVERCOMMIT", 1.0)
# Where a new sandbox goes among the nodes that can take it: spread (the one with the most free
# memory, then CPU) or pack (the fullest that still fits). See docs/fleet-scheduling.md.
HANGAR_PLACEMENT = env_str("HANGAR_PLACEMENT", "spread")
# How old each process's view of the placeable nodes may get before a placement reads it again
# (runtime/services/fleet_view.py); 0: read for every placement.
HANGAR_PLACEMENT_VIEW_S = env_float("HANGAR_PLACEMENT_VIEW_S", 1.0, minimum=0)
if HANGAR_PLACEMENT not in ("spread", "pack"):
    raise ImproperlyConfigured(f"HANGAR_PLACEMENT must be spread or pack, got {HANGAR_PLACEMENT!r}")
# A node with less free space than this where its sandboxes' disks are gets no new sandboxes.
HANGAR_NODE_MIN_FREE_DISK_MB = env_int("HANGAR_NODE_MIN_FREE_DISK_MB", 2048, minimum=0)
# What a joining node is handed for the database (runtime/services/node_roles.py): a Postgres
# role of its own with only what a node needs (auto: when this control plane's user may create
# roles, else its own credentials, with a warning; on: refuse the join without it; off: always
# the control plane's own credentials).
# A joining node's own Redis user (runtime/services/node_redis.py): auto, on or off, as above.
HANGAR_NODE_REDIS_USERS = env_str("HANGAR_NODE_REDIS_USERS", "auto")
if HANGAR_NODE_REDIS_USERS not in ("auto", "on", "off"):
    raise ImproperlyConfigured(
        f"HANGAR_NODE_REDIS_USERS must be auto, on or off, got {HANGAR_NODE_REDIS_USERS!r}"
    )
HANGAR_NODE_DB_ROLES = env_str("HANGAR_NODE_DB_ROLES", "auto")
if HANGAR_NODE_DB_ROLES not in ("auto", "on", "off"):
    raise ImproperlyConfigured(f"HANGAR_NODE_DB_ROLES must be auto, on or off, got {HANGAR_NODE_DB_ROLES!r}")
# A node silent this long is lost (docs/fleet.md): its death is seen within this many seconds.
HANGAR_NODE_OFFLINE_AFTER_S = env_int("HANGAR_NODE_OFFLINE_AFTER_S", 30, minimum=5)
HANGAR_SANDBOX_MIN_MEMORY_MB = env_int("HANGAR_SANDBOX_MIN_MEMORY_MB", 128, minimum=16)
HANGAR_SANDBOX_MAX_MEMORY_MB = env_int("HANGAR_SANDBOX_MAX_MEMORY_MB", 16384, minimum=16)
HANGAR_SANDBOX_MAX_CPU = env_float("HANGAR_SANDBOX_MAX_CPU", 16.0)
HANGAR_SANDBOX_MAX_TIMEOUT_S = env_int("HANGAR_SANDBOX_MAX_TIMEOUT_S", 86400, minimum=1)
# A sandbox's writable layer (every file it writes outside its volumes) is a filesystem of its
# own of disk_mb, this size unless the create asks for another: a write past it fails inside
# the sandbox (ENOSPC) and the node's disk is never filled. Sparse, so it costs the node only
# what is written. 0: sandboxes that ask for no size write to the node's filesystem, unlimited.
HANGAR_SANDBOX_DISK_MB = env_int("HANGAR_SANDBOX_DISK_MB", 10 * 1024, minimum=0)
HANGAR_SANDBOX_MIN_DISK_MB = 64
HANGAR_SANDBOX_MAX_DISK_MB = env_int(
    "HANGAR_SANDBOX_MAX_DISK_MB", 100 * 1024, minimum=HANGAR_SANDBOX_MIN_DISK_MB
)
if (
    HANGAR_SANDBOX_DISK_MB
    and not HANGAR_SANDBOX_MIN_DISK_MB <= HANGAR_SANDBOX_DISK_MB <= HANGAR_SANDBOX_MAX_DISK_MB
):
    raise ImproperlyConfigured(
        f"HANGAR_SANDBOX_DISK_MB must be 0 or between {HANGAR_SANDBOX_MIN_DISK_MB} and HANGAR_SANDBOX_MAX_DISK_MB "
        f"({HANGAR_SANDBOX_MAX_DISK_MB}), got {HANGAR_SANDBOX_DISK_MB}"
    )
# Disks of the default size each node keeps made ahead (~8 ms each, off the create path).
HANGAR_SPARE_DISKS = env_int("HANGAR_SPARE_DISKS", 2, minimum=0)
HANGAR_EXEC_MAX_TIMEOUT_S = env_int("HANGAR_EXEC_MAX_TIMEOUT_S", 3600, minimum=1)
HANGAR_EXEC_KEEP_OUTPUT_BYTES = env_int("HANGAR_EXEC_KEEP_OUTPUT_BYTES", 64 * 1024, minimum=0)
HANGAR_EXEC_MAX_OUTPUT_BYTES = env_int("HANGAR_EXEC_MAX_OUTPUT_BYTES", 64 * 1024 * 1024, minimum=1024)
# A blocking exec holds its output (up to the limit above, per stream) until its answer is
# sent: how many one team may have in flight on one server process (past it, 429).
HANGAR_EXEC_BLOCKING_PER_TEAM = env_int("HANGAR_EXEC_BLOCKING_PER_TEAM", 8, minimum=1)
# The server holds an answer back while its client is not reading (dashboard/server.py); a
# client that takes nothing at all for this long is disconnected.
HANGAR_SEND_STALL_S = env_int("HANGAR_SEND_STALL_S", 300, minimum=1)
HANGAR_PROCESS_OUTPUT_BYTES = env_int("HANGAR_PROCESS_OUTPUT_BYTES", 4 * 1024 * 1024, minimum=64 * 1024)
# How often a node's bridge reports activity in its terminals (which pushes expiries out).
HANGAR_ACTIVITY_REPORT_S = env_int("HANGAR_ACTIVITY_REPORT_S", 30, minimum=1)
# Flow control of live output (see runtime/node/bridge.py): a flow-controlled viewer this far behind
# holds the command back; it runs again once the viewer is within the low mark.
HANGAR_FLOW_HIGH_BYTES = env_int("HANGAR_FLOW_HIGH_BYTES", 128 * 1024, minimum=4096)
HANGAR_FLOW_LOW_BYTES = env_int("HANGAR_FLOW_LOW_BYTES", 32 * 1024, minimum=1024)
# Input a live command has not read yet that its node keeps for it; more is refused.
HANGAR_STDIN_PENDING_BYTES = env_int("HANGAR_STDIN_PENDING_BYTES", 8 * 1024 * 1024, minimum=1024 * 1024)
# An NDJSON stream (a command's output, a run's log) with nothing to say this long sends a
# {"type":"keepalive"} line, so proxies and clients' read timeouts do not end a quiet stream.
HANGAR_STREAM_KEEPALIVE_S = env_int("HANGAR_STREAM_KEEPALIVE_S", 15, minimum=1)
HANGAR_TERMINAL_SCROLLBACK_BYTES = env_int("HANGAR_TERMINAL_SCROLLBACK_BYTES", 256 * 1024, minimum=64 * 1024)
HANGAR_FILE_MAX_BYTES = env_int("HANGAR_FILE_MAX_BYTES", 512 * 1024 * 1024, minimum=1024)
# The largest body of an API request that controls something (JSON); the endpoints that carry
# data have their own (file uploads: HANGAR_FILE_MAX_BYTES; input: see dashboard.limits).
HANGAR_JSON_MAX_BYTES = env_int("HANGAR_JSON_MAX_BYTES", 1024 * 1024, minimum=64 * 1024)
# A sandbox's metadata, as JSON: it comes back in every list of sandboxes.
HANGAR_METADATA_MAX_BYTES = env_int("HANGAR_METADATA_MAX_BYTES", 64 * 1024, minimum=1024)
# Rows of deleted sandboxes (with their events, commands and terminals) go this long after the
# deletion (0: kept for ever).
HANGAR_DELETED_RETENTION_DAYS = env_int("HANGAR_DELETED_RETENTION_DAYS", 30, minimum=0)
# Traces (OTLP ingest, docs/traces.md): kept this many days after their last span (0: forever);
# a string attribute over HANGAR_TRACE_VALUE_BYTES is cut in the span and kept whole beside it;
# an export request's body is limited to HANGAR_OTLP_MAX_BYTES (after gzip); at most
# HANGAR_OTLP_CONCURRENCY requests are stored at once per server process (more: 429, Retry-After).
HANGAR_TRACE_RETENTION_DAYS = env_int("HANGAR_TRACE_RETENTION_DAYS", 14, minimum=0)
HANGAR_TRACE_VALUE_BYTES = env_int("HANGAR_TRACE_VALUE_BYTES", 16 * 1024, minimum=256)
HANGAR_OTLP_MAX_BYTES = env_int("HANGAR_OTLP_MAX_BYTES", 16 * 1024 * 1024, minimum=1024)
HANGAR_OTLP_CONCURRENCY = env_int("HANGAR_OTLP_CONCURRENCY", 4, minimum=1)
HANGAR_CREATE_WAIT_S = env_int("HANGAR_CREATE_WAIT_S", 60, minimum=1)
# Site-wide quota defaults per team (a team's own limits and ceilings override them; site
# administrators change them in the API and the dashboard too: those win over these).
HANGAR_QUOTA_SANDBOXES = env_int("HANGAR_QUOTA_SANDBOXES", 50, minimum=0)
HANGAR_QUOTA_VCPU = env_float("HANGAR_QUOTA_VCPU", 64.0)
HANGAR_QUOTA_MEMORY_MB = env_int("HANGAR_QUOTA_MEMORY_MB", 128 * 1024, minimum=0)
HANGAR_QUOTA_STORAGE_MB = env_int("HANGAR_QUOTA_STORAGE_MB", 500 * 1024, minimum=0)
HANGAR_QUOTA_DISK_MB = env_int("HANGAR_QUOTA_DISK_MB", 1024 * 1024, minimum=0)
HANGAR_QUOTA_LIFETIME_S = env_int("HANGAR_QUOTA_LIFETIME_S", HANGAR_SANDBOX_MAX_TIMEOUT_S, minimum=1)
HANGAR_QUOTA_HARNESSES = env_int("HANGAR_QUOTA_HARNESSES", 20, minimum=0)
HANGAR_QUOTA_GPUS = env_int("HANGAR_QUOTA_GPUS", 0, minimum=0)
# Cost rates (any currency; 0: usage is metered but costs nothing). Usage is counted into
# hourly rollups as it accrues: at every change of state, and every HANGAR_METER_TICK_S (beat).
HANGAR_RATE_VCPU_HOUR = env_float("HANGAR_RATE_VCPU_HOUR", 0.0)
HANGAR_RATE_MEMORY_GB_HOUR = env_float("HANGAR_RATE_MEMORY_GB_HOUR", 0.0)
HANGAR_RATE_STORAGE_GB_HOUR = env_float("HANGAR_RATE_STORAGE_GB_HOUR", 0.0)
HANGAR_RATE_GPU_HOUR = env_float("HANGAR_RATE_GPU_HOUR", 0.0)
HANGAR_CURRENCY = env_str("HANGAR_CURRENCY", "USD")
# Fernet keys for team secrets, newest first, comma-separated (rotation: put a new key first,
# run `hangar secrets rotate`, then drop the old one). Empty: one generated under the data dir.
HANGAR_SECRETS_KEYS = [k.strip() for k in env_str("HANGAR_SECRETS_KEYS", "").split(",") if k.strip()]
# Sign-in with a password: failures past the free ones (an address gets four times as many) make
# each next attempt wait, doubling up to the most, for as long as failures keep coming within the window.
HANGAR_LOGIN_FREE_FAILURES = env_int("HANGAR_LOGIN_FREE_FAILURES", 5, minimum=1)
HANGAR_LOGIN_MAX_DELAY_S = env_int("HANGAR_LOGIN_MAX_DELAY_S", 900, minimum=1)
HANGAR_LOGIN_WINDOW_S = env_int("HANGAR_LOGIN_WINDOW_S", 3600, minimum=60)
HANGAR_INVITATION_TTL_S = env_int("HANGAR_INVITATION_TTL_S", 7 * 86400, minimum=60)
# Open websockets, SSH sessions and followed output streams check again who they act for this
# often, besides at once on a revocation or a change of membership (a lost message cannot keep
# one alive past this).
HANGAR_AUTH_RECHECK_S = env_float("HANGAR_AUTH_RECHECK_S", 30.0, minimum=0.1)
# Preview URLs: {scheme}://{port}-{sandbox id}.{domain}[:{port shown}]. *.localhost names the
# loopback in browsers, so the default works on one machine with no DNS set up.
# Sandbox networks: each sandbox with egress gets a /30 from this pool; the exceptions are
# CIDRs taken out of the always-denied ranges (a registry on the management network, say).
# Empty: the node takes the first /16 from 10.88.0.0 on that no other Hangar node on the machine
# holds and no route of the host's overlaps, and keeps it (runtime/host/hostnames.py).
HANGAR_NETWORK_POOL = env_str("HANGAR_NETWORK_POOL", "")
if HANGAR_NETWORK_POOL:
    import ipaddress as _ipaddress

    try:
        if _ipaddress.IPv4Network(HANGAR_NETWORK_POOL).prefixlen > 28:
            raise ValueError("smaller than a /28")
    except ValueError as _exc:
        raise ImproperlyConfigured(
            f"HANGAR_NETWORK_POOL must be an IPv4 network of /28 or more, got "
            f"{HANGAR_NETWORK_POOL!r} ({_exc})"
        ) from None
# Resolvers for sandboxes with egress "all" (default: the node's own, unless loopback).
HANGAR_NETWORK_NAMESERVERS = [
    c.strip() for c in env_str("HANGAR_NETWORK_NAMESERVERS", "").split(",") if c.strip()
]
HANGAR_NETWORK_EXCEPTIONS = [
    c.strip() for c in env_str("HANGAR_NETWORK_EXCEPTIONS", "").split(",") if c.strip()
]
# Launchers (isolation runtimes; docs/architecture.md): the ones this node runs (empty: every
# registered one whose probe passes here), the runtime of a sandbox that names none, launchers
# registered without packaging (name=module:Class,…), and each launcher's own settings block,
# which HANGAR_LAUNCHER_CONFIG (a JSON object of objects) extends or overrides.
HANGAR_LAUNCHER_CLASSES = env_launcher_classes("HANGAR_LAUNCHER_CLASSES")
HANGAR_LAUNCHERS = [n.strip() for n in env_str("HANGAR_LAUNCHERS", "").split(",") if n.strip()]
HANGAR_DEFAULT_RUNTIME = env_str("HANGAR_DEFAULT_RUNTIME", "gvisor")
HANGAR_LAUNCHER_CONFIG: dict[str, dict] = env_launcher_config(
    "HANGAR_LAUNCHER_CONFIG", {"gvisor": {"runsc": HANGAR_RUNSC, "platform": HANGAR_RUNSC_PLATFORM}}
)
check_launchers(HANGAR_LAUNCHER_CLASSES, HANGAR_LAUNCHERS, HANGAR_DEFAULT_RUNTIME)
# How servers reach sandboxes on other nodes (preview URLs): each node's bridge listens for
# signed tunnels on this port (0: none; a single machine needs none) at this address.
HANGAR_TUNNEL_PORT = env_int("HANGAR_TUNNEL_PORT", 0, minimum=0)
HANGAR_NODE_ADDRESS = env_str("HANGAR_NODE_ADDRESS", "127.0.0.1")
HANGAR_PREVIEW_DOMAIN = env_str("HANGAR_PREVIEW_DOMAIN", "localhost").strip(".").lower()
HANGAR_PREVIEW_SCHEME = env_str("HANGAR_PREVIEW_SCHEME", "http")
HANGAR_PREVIEW_PORT = env_int("HANGAR_PREVIEW_PORT", env_int("HANGAR_PORT", 8000), minimum=0)
HANGAR_PREVIEW_TOKEN_TTL_S = env_int("HANGAR_PREVIEW_TOKEN_TTL_S", 86400, minimum=60)
HANGAR_PREVIEW_RESUME_WAIT_S = env_int("HANGAR_PREVIEW_RESUME_WAIT_S", 60, minimum=1)
# Harnesses: a workspace volume of this size unless the create says; their sandboxes pause
# (never end) when this lifetime runs out. What their agents reach Hangar at (the API, OTLP).
HANGAR_HARNESS_DISK_MB = env_int("HANGAR_HARNESS_DISK_MB", 10 * 1024, minimum=64)
HANGAR_HARNESS_TIMEOUT_S = env_int("HANGAR_HARNESS_TIMEOUT_S", HANGAR_SANDBOX_MAX_TIMEOUT_S, minimum=60)
HANGAR_HARNESS_IDLE_TIMEOUT_S = env_int("HANGAR_HARNESS_IDLE_TIMEOUT_S", 3600, minimum=0)  # 0: never
HANGAR_HARNESS_RESUME_WAIT_S = env_int("HANGAR_HARNESS_RESUME_WAIT_S", 90, minimum=1)
HANGAR_RUN_MAX_TIMEOUT_S = env_int("HANGAR_RUN_MAX_TIMEOUT_S", HANGAR_EXEC_MAX_TIMEOUT_S, minimum=1)
HANGAR_PUBLIC_URL = env_str("HANGAR_PUBLIC_URL", f"http://localhost:{env_int('HANGAR_PORT', 8000)}").rstrip(
    "/"
)
# Sandboxes allowed to (harnesses) reach Hangar at hangar.internal:<this port>, on the node's
# side of their network, where the node's bridge forwards to HANGAR_INTERNAL_URL (0: nowhere).
HANGAR_SANDBOX_GATEWAY_PORT = env_int("HANGAR_SANDBOX_GATEWAY_PORT", 8719, minimum=0)
HANGAR_INTERNAL_URL = env_str(
    "HANGAR_INTERNAL_URL", f"http://127.0.0.1:{env_int('HANGAR_PORT', 8000)}"
).rstrip("/")
_SANDBOX_HANGAR = (
    f"http://hangar.internal:{HANGAR_SANDBOX_GATEWAY_PORT}"
    if HANGAR_SANDBOX_GATEWAY_PORT
    else HANGAR_PUBLIC_URL
)
HANGAR_SANDBOX_API_URL = env_str("HANGAR_SANDBOX_API_URL", _SANDBOX_HANGAR + "/api/v1")
HANGAR_SANDBOX_OTLP_ENDPOINT = env_str("HANGAR_SANDBOX_OTLP_ENDPOINT", _SANDBOX_HANGAR)
# A PEM bundle on the node that every sandbox trusts (an organisation's CA on a network that
# inspects TLS): see runtime/launchers/agent/ca.py.
HANGAR_SANDBOX_CA_CERTS = env_pem_file("HANGAR_SANDBOX_CA_CERTS")
# The SSH gateway into harnesses (`hangar up` starts it; 0: none). The host key is made once
# under the data dir. HANGAR_SSH_HOST is the host name shown in the command to copy.
HANGAR_SSH_PORT = env_int("HANGAR_SSH_PORT", 2222, minimum=0)
HANGAR_SSH_BIND = env_str("HANGAR_SSH_BIND", "127.0.0.1")  # 0.0.0.0: reachable from other machines
HANGAR_SSH_HOST = env_str("HANGAR_SSH_HOST", "localhost")
HANGAR_SSH_HOST_KEY = Path(env_str("HANGAR_SSH_HOST_KEY", str(DATA_DIR / "ssh_host_ed25519_key")))

# Form and JSON bodies Django reads whole; the API's own routes set each their limit
# (dashboard.limits), which its requests check instead.
DATA_UPLOAD_MAX_MEMORY_SIZE = HANGAR_JSON_MAX_BYTES

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("HANGAR_LOG_LEVEL", "INFO")},
    # The MCP SDK logs two INFO lines for every request to /mcp (dashboard.mcp).
    "loggers": {
        "django.channels.server": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "mcp": {"level": "WARNING"},
    },
}
