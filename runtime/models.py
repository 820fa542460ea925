"""Hangar's state: teams, tokens, nodes, images, sandboxes and what happened to them."""

from __future__ import annotations

import secrets
import string
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_id(prefix: str, length: int = 16) -> str:
    # Lowercase letters and digits only: ids become host names and DNS labels (preview URLs).
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def new_sandbox_id() -> str:
    return new_id("sb")


def new_terminal_id() -> str:
    return new_id("tm", 12)


def new_volume_id() -> str:
    return new_id("vol", 12)


def new_pool_id() -> str:
    return new_id("pool", 10)


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner"
        ADMIN = "admin"
        MEMBER = "member"
        VIEWER = "viewer"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="membership_unique")]


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=12)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Issued with this role (never above its user's; what it may do is the lower of this and the
    # user's role in the team now); blank: whatever the user's role is. Scopes: none means all.
    role = models.CharField(max_length=16, blank=True)
    scopes = models.JSONField(default=list, blank=True)
    # A harness's own token reaches only that harness's sandbox and the sandboxes it made
    # (``auth.sandbox_reach``). Deleting the harness row deletes it: unbound, it would reach
    # the whole team.
    harness = models.ForeignKey("Harness", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    # Not a column: the role a live token acts with (the lower of its own and its user's in the
    # team now), set by ``auth.token_authenticate`` on the token it returns.
    effective_role: str


class Node(models.Model):
    class State(models.TextChoices):
        """``ready`` takes new sandboxes; ``cordoned`` keeps what it runs but takes none;
        ``draining`` is cordoned while what it runs moves or ends; ``removed`` is gone for good
        (until it joins again); ``lost`` stopped answering heartbeats (docs/fleet.md)."""

        READY = "ready"
        CORDONED = "cordoned"
        DRAINING = "draining"
        REMOVED = "removed"
        LOST = "lost"

    name = models.CharField(max_length=100, unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY)
    # While lost: the state it had (ready, cordoned, draining), which it gets back on its return.
    state_before_lost = models.CharField(max_length=16, blank=True)
    # The runtimes it runs and what their sandboxes can have, as its heartbeat says:
    # {"<runtime>": {"network": true, "checkpoint": true, "kvm": false, "gpu": false}}.
    launchers = models.JSONField(default=dict)
    cpu_capacity = models.FloatField(default=1.0)
    memory_mb_capacity = models.IntegerField(default=1024)
    version = models.CharField(max_length=32, blank=True)
    tunnel_address = models.CharField(max_length=200, blank=True)  # host:port of its tunnels
    # The operator's labels ({"zone": "a", "gpu": "h100"}), matched by a sandbox's node_selector.
    labels = models.JSONField(default=dict, blank=True)
    # Free space where its sandboxes' disks are (they are thin), as of its last heartbeat.
    disk_free_mb = models.IntegerField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # What its sandboxes that hold CPU and memory take (placement.ACTIVE), kept by the database
    # itself: triggers on the sandbox table move them in the transaction that changes a row
    # (migration 0025), so they are never stale and placement reads them instead of summing.
    millicpu_allocated = models.IntegerField(default=0, editable=False)
    memory_mb_allocated = models.IntegerField(default=0, editable=False)

    COUNTERS = ("millicpu_allocated", "memory_mb_allocated")

    def save(self, *args: Any, **kwargs: Any) -> None:
        # A whole-row save of a loaded node must not write back counters it read earlier.
        if not self._state.adding and kwargs.get("update_fields") is None:
            kwargs["update_fields"] = [
                f.name
                for f in self._meta.concrete_fields
                if not f.primary_key and f.name not in self.COUNTERS
            ]
        super().save(*args, **kwargs)

    @property
    def queue(self) -> str:
        return f"node.{self.name}"

    @property
    def runtimes(self) -> list[str]:
        return sorted(self.launchers or {})

    def can(self, runtime: str, capability: str) -> bool:
        """Whether sandboxes of ``runtime`` here can have ``capability`` (network, checkpoint…)."""
        return bool((self.launchers or {}).get(runtime, {}).get(capability))

    def __str__(self) -> str:
        return self.name


class NodeJoinToken(models.Model):
    """What lets a new machine join as a node (``hangar node join``): issued by staff, stored
    as a hash, good for ``uses`` joins until ``expires_at`` unless revoked."""

    prefix = models.CharField(max_length=12)
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    uses = models.IntegerField(default=1)  # how many joins it allows
    used = models.IntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)
    nodes = models.JSONField(default=list, blank=True)  # the names that joined with it

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.prefix


class NodeRedisUser(models.Model):
    """A joined node's own Redis user (runtime/services/node_redis.py): its name and the SHA-256
    of the password it was handed, which the control plane gives Redis again should Redis lose
    its users (a restart without an ACL file). Never granted to nodes' database roles."""

    node_name = models.CharField(max_length=100, unique=True)
    username = models.CharField(max_length=64, unique=True)
    password_sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.username


class Image(models.Model):
    """An image name known to the control plane; ``nodes`` are those that hold its rootfs."""

    name = models.CharField(max_length=128, unique=True)
    digest = models.CharField(max_length=80)
    size_bytes = models.BigIntegerField(default=0)
    source = models.CharField(max_length=300, blank=True)
    config = models.JSONField(default=dict)
    nodes = models.ManyToManyField(Node, related_name="images", blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name


class ImageJob(models.Model):
    """A build or registry pull of an image on a node, with its progress log: images take
    seconds to minutes, and the dashboard shows them as they go."""

    class Kind(models.TextChoices):
        BUILD = "build"
        PULL = "pull"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    ref = models.CharField(max_length=300)  # build: busybox | base; pull: the registry reference
    name = models.CharField(max_length=128, blank=True)  # the image's name here ("" = from ref)
    tls_verify = models.BooleanField(default=True)
    node = models.ForeignKey(Node, null=True, on_delete=models.SET_NULL, related_name="image_jobs")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    log = models.TextField(blank=True)  # the last lines of progress
    error = models.TextField(blank=True)
    image = models.ForeignKey(Image, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} {self.ref}"

    @property
    def took_s(self) -> float | None:
        """Seconds from start to end (so far, while it runs); None until it starts."""
        if self.started_at is None:
            return None
        end = self.finished_at or timezone.now()
        return (end - self.started_at).total_seconds()


class Volume(models.Model):
    """A team's persistent filesystem of a fixed size, kept on one node, mounted into the
    sandboxes that attach it. Deleting a sandbox never deletes a volume."""

    id = models.CharField(primary_key=True, max_length=32, default=new_volume_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="volumes")
    name = models.CharField(max_length=64)
    size_mb = models.IntegerField()
    node = models.ForeignKey(Node, null=True, on_delete=models.SET_NULL, related_name="volumes")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    metered_at = models.DateTimeField(null=True, blank=True)  # storage counted up to here

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="volume_name_unique_in_team")]

    def __str__(self) -> str:
        return self.name


def default_runtime() -> str:
    return str(settings.HANGAR_DEFAULT_RUNTIME)


def default_disk_mb() -> int:
    return int(settings.HANGAR_SANDBOX_DISK_MB)


class Pool(models.Model):
    """A warm pool: ``size`` sandboxes of one spec kept started and unclaimed for the team."""

    id = models.CharField(primary_key=True, max_length=32, default=new_pool_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="pools")
    image = models.CharField(max_length=128)
    runtime = models.CharField(max_length=32, default=default_runtime)
    cpu = models.FloatField(default=1.0)
    memory_mb = models.IntegerField(default=512)
    disk_mb = models.IntegerField(default=default_disk_mb)
    # Members start with a network of their own and nothing let out; a claim puts the
    # caller's egress policy in force (creates with a network claim only from such pools).
    network = models.BooleanField(default=False)
    # Labels its members' nodes must carry ({"zone": "a"}), as a sandbox's node_selector.
    node_selector = models.JSONField(default=dict, blank=True)
    size = models.IntegerField(default=1)
    last_error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.id


class Sandbox(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        STARTING = "starting"
        RUNNING = "running"
        STOPPING = "stopping"
        STOPPED = "stopped"
        FAILED = "failed"
        DELETED = "deleted"
        PAUSING = "pausing"
        PAUSED = "paused"  # processes gone, files kept: costs only its disk
        RESUMING = "resuming"

    ACTIVE = (Status.PENDING, Status.STARTING, Status.RUNNING, Status.STOPPING)

    id = models.CharField(primary_key=True, max_length=32, default=new_sandbox_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="sandboxes")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    image = models.CharField(max_length=128)
    image_digest = models.CharField(max_length=80)
    runtime = models.CharField(max_length=32, default=default_runtime)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="sandboxes")
    # Labels its node must carry, every one of them ({"zone": "a"}); empty: any node.
    node_selector = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING, db_index=True)
    status_reason = models.TextField(blank=True)
    cpu = models.FloatField(default=1.0)
    memory_mb = models.IntegerField(default=512)
    # The size of its own writable layer; 0: none of its own (the node's filesystem, no limit).
    disk_mb = models.IntegerField(default=default_disk_mb)
    timeout_s = models.IntegerField(default=300)
    env = models.JSONField(default=dict)
    metadata = models.JSONField(default=dict)
    handle = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    # An ephemeral sandbox keeps nothing outside its volumes when paused.
    ephemeral = models.BooleanField(default=False)
    on_expire = models.CharField(max_length=16, default="destroy")  # pause | destroy
    # How a pause keeps it (stop | checkpoint) unless the call says; and, while it is paused
    # (or pausing, resuming), how it was.
    pause_mode = models.CharField(max_length=16, default="stop")
    paused_mode = models.CharField(max_length=16, blank=True)
    idle_timeout_s = models.IntegerField(null=True, blank=True)  # idle that long: paused
    last_activity_at = models.DateTimeField(null=True, blank=True)
    # A warm pool's member: nobody's until claimed (then it is the claimer's like any other).
    pool = models.ForeignKey(Pool, null=True, blank=True, on_delete=models.SET_NULL, related_name="members")
    claimed_at = models.DateTimeField(null=True, blank=True)
    # Team secrets given to it as environment variables (names only: values stay encrypted).
    secrets = models.JSONField(default=list, blank=True)
    # Usage is counted up to here while it holds CPU and memory (None: it holds none).
    metered_at = models.DateTimeField(null=True, blank=True)
    # Storage is counted up to here while it holds its own disk (None: it holds none).
    disk_metered_at = models.DateTimeField(null=True, blank=True)
    # Ports of servers inside that have a preview URL: [{"port": 8000, "public": false}].
    ports = models.JSONField(default=list, blank=True)
    # Every port of it has a preview URL as well (E2B's sandboxes: its SDK's get_host(port)):
    # "public" (anyone), "private" (with its traffic access token, or Hangar's own ways in);
    # "": only ``ports``.
    open_ports = models.CharField(max_length=8, blank=True, default="")
    # Egress: {"egress": "none" | "allowlist" | "all", "allow": [...]}; {} is none.
    network = models.JSONField(default=dict, blank=True)
    auto_resume = models.BooleanField(default=False)  # a preview request resumes it when paused
    # The token that created it, when one did: a harness's token reaches what it made.
    created_by_token = models.ForeignKey(
        ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["team", "status"]),
            models.Index(fields=["node", "status"]),
        ]

    def __str__(self) -> str:
        return self.id


class SandboxVolume(models.Model):
    """A volume attached to a sandbox at ``mount_path``. The attachment holds the volume (it
    cannot be deleted) until the sandbox is deleted."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="volume_mounts")
    volume = models.ForeignKey(Volume, on_delete=models.CASCADE, related_name="attachments")
    mount_path = models.CharField(max_length=512)
    read_only = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["sandbox", "mount_path"], name="one_volume_per_mount_path")
        ]


class SandboxEvent(models.Model):
    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=32)
    status_from = models.CharField(max_length=16, blank=True)
    status_to = models.CharField(max_length=16, blank=True)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["created_at", "id"]


class Exec(models.Model):
    """One command run in a sandbox. ``kind``: ``run`` (to completion in the request),
    ``stream`` (its output streamed to the caller as it comes), ``background`` (returns at once;
    reattach to it as a process). Streamed and background ones are live processes of the node's
    stream bridge while they run."""

    class Kind(models.TextChoices):
        RUN = "run"
        STREAM = "stream"
        BACKGROUND = "background"

    class Status(models.TextChoices):
        RUNNING = "running"
        EXITED = "exited"
        FAILED = "failed"  # could not start, or lost (the message is in ``error``)

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="execs")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.RUN)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.EXITED)
    pid = models.IntegerField(null=True, blank=True)
    timeout_s = models.FloatField(null=True, blank=True)
    signal = models.IntegerField(default=0)
    argv = models.JSONField(default=list)
    cwd = models.CharField(max_length=4096, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    timed_out = models.BooleanField(default=False)
    stdout = models.TextField(blank=True)
    stderr = models.TextField(blank=True)
    stdout_bytes = models.BigIntegerField(default=0)
    stderr_bytes = models.BigIntegerField(default=0)
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["sandbox", "status"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(stdout_bytes__gte=0) & Q(stderr_bytes__gte=0), name="exec_bytes_nonneg"
            )
        ]


class Terminal(models.Model):
    """A shell on a PTY inside a sandbox, held by the node's stream bridge; viewers come and go."""

    class Status(models.TextChoices):
        RUNNING = "running"
        EXITED = "exited"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=32, default=new_terminal_id, editable=False)
    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="terminals")
    name = models.CharField(max_length=64, blank=True)
    argv = models.JSONField(default=list)
    cwd = models.CharField(max_length=4096, blank=True)
    rows = models.IntegerField(default=24)
    cols = models.IntegerField(default=80)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING, db_index=True)
    pid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.id


class TeamPolicy(models.Model):
    """A team's quotas, cost rates and budget. ``ceilings`` are set by site administrators
    (a key not there: the site default); ``limits`` by the team's admins, never above the
    ceiling (a key not there: the ceiling). Keys: :data:`runtime.services.quotas.QUOTAS`."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="policy")
    limits = models.JSONField(default=dict, blank=True)
    ceilings = models.JSONField(default=dict, blank=True)
    rates = models.JSONField(default=dict, blank=True)  # staff: cost per unit, over the site's
    budget = models.FloatField(null=True, blank=True)  # per calendar month, in the rates' currency
    budget_enforced = models.BooleanField(default=False)  # at 100%: no new sandboxes
    budget_warned = models.CharField(max_length=7, blank=True)  # "YYYY-MM" once warned at 80%
    updated_at = models.DateTimeField(auto_now=True)


class SiteDefaults(models.Model):
    """The site-wide quota defaults and cost rates (one row), over the settings' values."""

    quotas = models.JSONField(default=dict, blank=True)
    rates = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(auto_now=True)


class Secret(models.Model):
    """A team's secret: the value is encrypted (Fernet) and never shown again after creation."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(max_length=128)
    ciphertext = models.BinaryField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="secret_name_unique_in_team")]

    def __str__(self) -> str:
        return self.name


class Invitation(models.Model):
    """A link that makes whoever signs in with it a member of the team with ``role``; only its
    hash is stored. Used once, or revoked, or expired."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    role = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    accepted_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]


class UsageHour(models.Model):
    """What a team used in one hour (UTC), added to as it accrues."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage")
    hour = models.DateTimeField()
    vcpu_seconds = models.FloatField(default=0)
    memory_gb_seconds = models.FloatField(default=0)
    storage_gb_hours = models.FloatField(default=0)
    gpu_seconds = models.FloatField(default=0)
    sandboxes = models.IntegerField(default=0)  # sandboxes started in the hour

    class Meta:
        ordering = ["hour"]
        constraints = [models.UniqueConstraint(fields=["team", "hour"], name="usage_one_row_per_team_hour")]


class AuditEvent(models.Model):
    """One change, append-only (the database refuses UPDATE and DELETE on this table). Team
    and actor are kept by id and name, not as foreign keys, so the record outlives them."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    team_id_ref = models.IntegerField(null=True, blank=True, db_index=True)
    team_name = models.CharField(max_length=100, blank=True)
    actor_id = models.IntegerField(null=True, blank=True)
    actor = models.CharField(max_length=150, blank=True)  # user name; "" for Hangar itself
    via = models.CharField(max_length=16)  # api | dashboard | cli | ssh | system
    token = models.CharField(max_length=16, blank=True)  # the API token's prefix
    session = models.CharField(max_length=16, blank=True)  # a hash of the session key
    ip = models.CharField(max_length=64, blank=True)
    action = models.CharField(max_length=64, db_index=True)  # sandbox.create, member.add…
    target = models.CharField(max_length=200, blank=True)
    outcome = models.CharField(max_length=16, default="ok")  # ok | refused | error
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]


def new_harness_id() -> str:
    return new_id("hr", 12)


def new_run_id() -> str:
    return new_id("run", 12)


class Harness(models.Model):
    """A persistent workspace for a coding agent: a sandbox whose ``/workspace`` is a volume of
    its own, a connected git repository, the agent's credentials (team secrets, given as
    environment variables), terminals, SSH and runs. The sandbox is paused and resumed with the
    harness; the volume outlives both unless deleting the harness says otherwise."""

    class Setup(models.TextChoices):
        PENDING = "pending"  # waiting for its sandbox
        RUNNING = "running"  # cloning the repository, installing the agent
        DONE = "done"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=32, default=new_harness_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="harnesses")
    name = models.CharField(max_length=63)  # the SSH user name: unique among the team's live ones
    agent = models.CharField(max_length=32)  # a preset: runtime.presets.PRESETS
    command = models.JSONField(default=list, blank=True)  # custom: argv
    image = models.CharField(max_length=128)
    runtime = models.CharField(max_length=32, default=default_runtime)
    cpu = models.FloatField(default=1.0)
    memory_mb = models.IntegerField(default=2048)
    disk_mb = models.IntegerField(default=10240)
    repo_url = models.CharField(max_length=1000, blank=True)
    repo_branch = models.CharField(max_length=255, blank=True)
    repo_secret = models.CharField(max_length=128, blank=True)  # a team secret's name
    secrets = models.JSONField(default=list, blank=True)  # team secrets given as env vars (names)
    env = models.JSONField(default=dict, blank=True)
    network = models.JSONField(default=dict, blank=True)
    idle_timeout_s = models.IntegerField(null=True, blank=True)
    sandbox = models.ForeignKey(
        Sandbox, null=True, blank=True, on_delete=models.SET_NULL, related_name="harnesses"
    )
    volume = models.ForeignKey(
        Volume, null=True, blank=True, on_delete=models.SET_NULL, related_name="harnesses"
    )
    setup = models.CharField(max_length=16, choices=Setup.choices, default=Setup.PENDING)
    setup_error = models.TextField(blank=True)
    agent_version = models.CharField(max_length=200, blank=True)
    # The harness's own API token (team-scoped, so the agent can start sandboxes): encrypted
    # like a secret, given to its sandbox as HANGAR_API_TOKEN, revoked with the harness.
    api_token = models.ForeignKey(
        ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    api_token_ciphertext = models.BinaryField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "name"],
                condition=Q(deleted_at__isnull=True),
                name="harness_name_unique_in_team",
            )
        ]

    def __str__(self) -> str:
        return self.name


class Run(models.Model):
    """One task given to a harness's agent: the prompt, the process that ran it, its final
    status, and the diff it left in ``/workspace``."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        TIMED_OUT = "timed_out"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    id = models.CharField(primary_key=True, max_length=32, default=new_run_id, editable=False)
    harness = models.ForeignKey(Harness, on_delete=models.CASCADE, related_name="runs")
    prompt = models.TextField()
    timeout_s = models.IntegerField(default=3600)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    exit_code = models.IntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    argv = models.JSONField(default=list, blank=True)
    exec = models.ForeignKey(Exec, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    tree_before = models.CharField(max_length=64, blank=True)  # the workspace's tree at the start
    diff = models.TextField(blank=True)
    diff_truncated = models.BooleanField(default=False)
    cancel_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id


class HarnessLogEntry(models.Model):
    """A chunk of a harness's log: setup output (clone, install), its runs' starts and ends,
    and what happened to it. Secrets' values are masked before a chunk is written."""

    harness = models.ForeignKey(Harness, on_delete=models.CASCADE, related_name="log_entries")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    source = models.CharField(max_length=16)  # setup | run | event
    text = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]


class SshKey(models.Model):
    """A user's public key for the SSH gateway; a key belongs to one user."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ssh_keys")
    name = models.CharField(max_length=100)
    public_key = models.TextField()  # one line, OpenSSH format
    fingerprint = models.CharField(max_length=100, unique=True)  # SHA256:…
    # Registered with an API token: it opens only that token's team's harnesses (a token is a
    # team's; from the dashboard, a key opens every team of the user's).
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    # The most it acts as ("": the user's role in the team): a key registered with a token acts
    # at most as that token could (its role; a viewer's without the harnesses:write scope).
    role = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [models.UniqueConstraint(fields=["user", "name"], name="ssh_key_name_unique_per_user")]


from .trace_models import Trace, TraceLog, TraceSpan, TraceValue  # noqa: E402,F401 - the app's models
