# Nodes advertise their runtimes with capabilities (Node.launchers replaces Node.runtimes);
# a sandbox's and a pool's default runtime is the setting HANGAR_DEFAULT_RUNTIME.

import runtime.models
from django.db import migrations, models


def runtimes_to_launchers(apps, schema_editor):
    # What they can do is unknown until each node's next heartbeat says (every 10 s).
    Node = apps.get_model("runtime", "Node")
    for node in Node.objects.all():
        node.launchers = {name: {} for name in node.runtimes or []}
        node.save(update_fields=["launchers"])


def launchers_to_runtimes(apps, schema_editor):
    Node = apps.get_model("runtime", "Node")
    for node in Node.objects.all():
        node.runtimes = sorted(node.launchers or {})
        node.save(update_fields=["runtimes"])


class Migration(migrations.Migration):

    dependencies = [
        ('runtime', '0019_token_harness_and_sandbox_created_by_token'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='launchers',
            field=models.JSONField(default=dict),
        ),
        migrations.RunPython(runtimes_to_launchers, launchers_to_runtimes),
        migrations.RemoveField(
            model_name='node',
            name='runtimes',
        ),
        migrations.AlterField(
            model_name='pool',
            name='runtime',
            field=models.CharField(default=runtime.models.default_runtime, max_length=32),
        ),
        migrations.AlterField(
            model_name='sandbox',
            name='runtime',
            field=models.CharField(default=runtime.models.default_runtime, max_length=32),
        ),
    ]
