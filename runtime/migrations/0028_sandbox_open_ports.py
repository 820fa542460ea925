from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runtime", "0027_harness_runtime")]

    operations = [
        migrations.AddField(
            model_name="sandbox",
            name="open_ports",
            field=models.CharField(blank=True, default="", max_length=8),
        ),
    ]
