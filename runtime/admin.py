from django.contrib import admin

from .models import ApiToken, Exec, Image, Membership, Node, Sandbox, SandboxEvent, Team


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "team", "role", "created_at")
    list_filter = ("role",)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    # The hash is never shown: it is useless to a person and only helps an attacker.
    list_display = (
        "prefix",
        "name",
        "user",
        "team",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    exclude = ("token_hash",)
    readonly_fields = ("prefix", "last_used_at")


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "cpu_capacity", "memory_mb_capacity", "heartbeat_at", "version")
    list_filter = ("state",)


@admin.register(Image)
class ImageAdmin(admin.ModelAdmin):
    list_display = ("name", "digest", "size_bytes", "updated_at")


class EventInline(admin.TabularInline):
    model = SandboxEvent
    extra = 0
    readonly_fields = ("kind", "status_from", "status_to", "message", "created_at")
    can_delete = False


@admin.register(Sandbox)
class SandboxAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "team",
        "status",
        "image",
        "runtime",
        "node",
        "cpu",
        "memory_mb",
        "created_at",
        "expires_at",
    )
    list_filter = ("status", "runtime", "node")
    search_fields = ("id",)
    # env may hold credentials: never rendered on a page.
    exclude = ("env",)
    readonly_fields = ("handle",)
    inlines = [EventInline]


@admin.register(Exec)
class ExecAdmin(admin.ModelAdmin):
    list_display = ("id", "sandbox", "exit_code", "timed_out", "duration_ms", "started_at")
