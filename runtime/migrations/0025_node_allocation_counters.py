"""Allocation counters on the node row (``millicpu_allocated``, ``memory_mb_allocated``): what
its sandboxes that hold CPU and memory take, kept by triggers on the sandbox table, so that a
placement reads one row per node instead of summing every sandbox of every node.

A sandbox holds its CPU (in thousandths, so the sums are exact) and memory on its node while its
status is one of ``HELD`` (``runtime.services.placement.ACTIVE``). The triggers fire only when
that contribution changes (a row inserted holding, a status entering or leaving ``HELD``, a
change of node, CPU or memory while holding, a row deleted holding), in the same transaction as
the change, whichever code path makes it (a save, a bulk ``update()``, a delete, SQL by hand).
Transitions between held statuses (pending → starting → running) do not touch the node's row.
"""

from django.db import migrations, models

HELD = ("pending", "starting", "running", "pausing", "resuming")
_IN = "(" + ", ".join(f"'{s}'" for s in HELD) + ")"
OLD_HOLDS = f"(OLD.node_id IS NOT NULL AND OLD.status IN {_IN})"
NEW_HOLDS = f"(NEW.node_id IS NOT NULL AND NEW.status IN {_IN})"
# On an update: when what the row holds, or where, or how much, changes.
CHANGED = (
    f"({OLD_HOLDS} <> {NEW_HOLDS} OR ({OLD_HOLDS} AND {NEW_HOLDS} AND ("
    "OLD.node_id <> NEW.node_id OR OLD.cpu <> NEW.cpu OR OLD.memory_mb <> NEW.memory_mb)))"
)
PG_CAST = "({})::integer"
SQLITE_CAST = "CAST({} AS INTEGER)"


def _move(sign: str, row: str, cast: str) -> str:
    millicpu = cast.format(f"round({row}.cpu * 1000)")
    return (
        f"UPDATE runtime_node SET millicpu_allocated = millicpu_allocated {sign} {millicpu}, "
        f"memory_mb_allocated = memory_mb_allocated {sign} {row}.memory_mb WHERE id = {row}.node_id"
    )


TRIGGERS = {
    "postgresql": [
        f"""CREATE OR REPLACE FUNCTION runtime_sandbox_allocation() RETURNS trigger AS $$
           BEGIN
             IF TG_OP IN ('UPDATE', 'DELETE') AND {OLD_HOLDS} THEN {_move("-", "OLD", PG_CAST)}; END IF;
             IF TG_OP IN ('INSERT', 'UPDATE') AND {NEW_HOLDS} THEN {_move("+", "NEW", PG_CAST)}; END IF;
             RETURN NULL;
           END; $$ LANGUAGE plpgsql""",
        f"""CREATE TRIGGER runtime_sandbox_allocation_insert AFTER INSERT ON runtime_sandbox
           FOR EACH ROW WHEN {NEW_HOLDS} EXECUTE FUNCTION runtime_sandbox_allocation()""",
        f"""CREATE TRIGGER runtime_sandbox_allocation_update AFTER UPDATE ON runtime_sandbox
           FOR EACH ROW WHEN {CHANGED} EXECUTE FUNCTION runtime_sandbox_allocation()""",
        f"""CREATE TRIGGER runtime_sandbox_allocation_delete AFTER DELETE ON runtime_sandbox
           FOR EACH ROW WHEN {OLD_HOLDS} EXECUTE FUNCTION runtime_sandbox_allocation()""",
    ],
    "sqlite": [
        f"""CREATE TRIGGER runtime_sandbox_allocation_insert AFTER INSERT ON runtime_sandbox
           WHEN {NEW_HOLDS} BEGIN {_move("+", "NEW", SQLITE_CAST)}; END""",
        f"""CREATE TRIGGER runtime_sandbox_allocation_update AFTER UPDATE ON runtime_sandbox
           WHEN {CHANGED} BEGIN
             {_move("-", "OLD", SQLITE_CAST)} AND {OLD_HOLDS};
             {_move("+", "NEW", SQLITE_CAST)} AND {NEW_HOLDS};
           END""",
        f"""CREATE TRIGGER runtime_sandbox_allocation_delete AFTER DELETE ON runtime_sandbox
           WHEN {OLD_HOLDS} BEGIN {_move("-", "OLD", SQLITE_CAST)}; END""",
    ],
}
DROP = {
    "postgresql": [
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_insert ON runtime_sandbox",
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_update ON runtime_sandbox",
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_delete ON runtime_sandbox",
        "DROP FUNCTION IF EXISTS runtime_sandbox_allocation()",
    ],
    "sqlite": [
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_insert",
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_update",
        "DROP TRIGGER IF EXISTS runtime_sandbox_allocation_delete",
    ],
}
# The counters of the rows already there (run after the triggers exist, in the same transaction).
RECOUNT = f"""UPDATE runtime_node SET
    millicpu_allocated = COALESCE((SELECT CAST(SUM(round(s.cpu * 1000)) AS INTEGER) FROM runtime_sandbox s
                                   WHERE s.node_id = runtime_node.id AND s.status IN {_IN}), 0),
    memory_mb_allocated = COALESCE((SELECT SUM(s.memory_mb) FROM runtime_sandbox s
                                    WHERE s.node_id = runtime_node.id AND s.status IN {_IN}), 0)"""


def _run(statements):
    def run(apps, schema_editor):
        for sql in statements.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql, params=None)

    return run


def recount(apps, schema_editor):
    if schema_editor.connection.vendor in TRIGGERS:
        schema_editor.execute(RECOUNT, params=None)


class Migration(migrations.Migration):
    dependencies = [("runtime", "0024_node_states_and_join_tokens")]

    operations = [
        migrations.AddField(
            model_name="node", name="millicpu_allocated", field=models.IntegerField(default=0, editable=False)
        ),
        migrations.AddField(
            model_name="node", name="memory_mb_allocated", field=models.IntegerField(default=0, editable=False)
        ),
        migrations.RunPython(_run(TRIGGERS), _run(DROP)),
        migrations.RunPython(recount, migrations.RunPython.noop),
    ]
