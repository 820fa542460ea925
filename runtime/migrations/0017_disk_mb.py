from django.db import migrations, models

import runtime.models


class Migration(migrations.Migration):
    """Sandboxes and pools get ``disk_mb``. Sandboxes made before it write to the node's own
    filesystem, with no limit: their rows say 0. Pools take the node's default size. Nodes
    report their free disk."""

    dependencies = [
        ("runtime", "0016_pool_network"),
    ]

    operations = [
        migrations.AddField(
            model_name="sandbox",
            name="disk_mb",
            field=models.IntegerField(default=0),
        ),
        migrations.AlterField(
            model_name="sandbox",
            name="disk_mb",
            field=models.IntegerField(default=runtime.models.default_disk_mb),
        ),
        migrations.AddField(
            model_name="node",
            name="disk_free_mb",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="pool",
            name="disk_mb",
            field=models.IntegerField(default=runtime.models.default_disk_mb),
        ),
    ]
