# Searching traces by span attribute (runtime.services.trace_search): a GIN index on the spans'
# attributes answers JSONB containment (`attributes @> '{"key": value}'`). Postgres only: SQLite
# has no GIN, and there the search reads the key instead. jsonb_path_ops: smaller and faster
# for containment, the one operator the search uses; its pending list (fastupdate, on by
# default) keeps the cost off each bulk insert of spans.
from django.db import migrations

CREATE = (
    "CREATE INDEX IF NOT EXISTS span_attrs_gin ON runtime_tracespan "
    "USING gin (attributes jsonb_path_ops)"
)
DROP = "DROP INDEX IF EXISTS span_attrs_gin"


def _on_postgres(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("runtime", "0021_traces")]

    operations = [migrations.RunPython(_on_postgres(CREATE), _on_postgres(DROP), elidable=False)]
