"""Node states: ``status`` (online, offline, draining) becomes ``state`` (ready, cordoned,
draining, removed, lost), today's rows carried over (online is ready, offline is lost); and
join tokens."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

FORWARD = {"online": "ready", "offline": "lost"}
BACKWARD = {"ready": "online", "cordoned": "online", "lost": "offline", "removed": "offline"}


def forward(apps, schema_editor):
    Node = apps.get_model("runtime", "Node")
    for old, new in FORWARD.items():
        Node.objects.filter(state=old).update(state=new)
    Node.objects.filter(state="lost").update(state_before_lost="ready")


def backward(apps, schema_editor):
    Node = apps.get_model("runtime", "Node")
    for old, new in BACKWARD.items():
        Node.objects.filter(state=old).update(state=new)


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0023_node_labels_node_selector"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RenameField(model_name="node", old_name="status", new_name="state"),
        migrations.AddField(
            model_name="node",
            name="state_before_lost",
            field=models.CharField(blank=True, max_length=16),
        ),
        migrations.RunPython(forward, backward),
        migrations.AlterField(
            model_name="node",
            name="state",
            field=models.CharField(
                choices=[("ready", "Ready"), ("cordoned", "Cordoned"), ("draining", "Draining"),
                         ("removed", "Removed"), ("lost", "Lost")],
                default="ready",
                max_length=16,
            ),
        ),
        migrations.CreateModel(
            name="NodeJoinToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("prefix", models.CharField(max_length=12)),
                ("token_hash", models.CharField(max_length=64, unique=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("expires_at", models.DateTimeField(blank=True, null=True)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                ("uses", models.IntegerField(default=1)),
                ("used", models.IntegerField(default=0)),
                ("last_used_at", models.DateTimeField(blank=True, null=True)),
                ("nodes", models.JSONField(blank=True, default=list)),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={"ordering": ["-created_at"]},
        ),
    ]
