from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Hangar runtime"
    default_auto_field = "django.db.models.BigAutoField"
