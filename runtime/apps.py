from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Hangar runtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.db.models.signals import m2m_changed, post_migrate, post_save

        from . import events
        from .launchers.registry import register_all
        from .models import Image, Node
        from .services import harnesses, node_roles, pools, previews, runs, usage
        from .services.auth import user_changed
        from .services.fleet_view import VIEW

        # Launchers registered in the settings, in every process (the server, workers, bridge).
        register_all(settings.HANGAR_LAUNCHER_CLASSES)
        post_save.connect(user_changed, sender=settings.AUTH_USER_MODEL, dispatch_uid="hangar-user-changed")
        # The features listen to what the lower layers announce (runtime/events.py).
        events.status_changing.connect(usage.on_transition)
        events.status_changed.connect(previews.on_status_changed)
        events.sandbox_claim.connect(pools.pool_claim)
        events.sandbox_started.connect(harnesses.harness_setup_enqueue)
        events.sandboxes_busy.connect(harnesses.harnesses_with_active_runs)
        events.process_ended.connect(runs.run_process_ended)
        # A node saved or an image's holders changed in this process: its placements see it at once.
        post_save.connect(VIEW.changed, sender=Node, dispatch_uid="hangar-fleet-view-node")
        m2m_changed.connect(VIEW.changed, sender=Image.nodes.through, dispatch_uid="hangar-fleet-view-images")
        # Tables a migration adds to what nodes may touch: their roles get them (docs/fleet.md).
        post_migrate.connect(node_roles.node_roles_regrant, sender=self, dispatch_uid="hangar-node-roles")
