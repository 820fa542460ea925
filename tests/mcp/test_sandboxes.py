"""A sandbox's whole life through MCP tools, with the MCP SDK's client against the real server,
worker, bridge and runsc: create, list, run a command, write, read and list files, a preview
URL, pause and resume, delete; and another team's token, which reaches none of it."""

from __future__ import annotations

import anyio

from tests.support import requires_runsc

from .conftest import call, connect, issue, ok, text


@requires_runsc
def test_a_sandbox_from_create_to_delete(sandboxes, team_token):
    read_only = issue(scopes=["sandboxes:read"]).raw

    async def main():
        async with connect(sandboxes, team_token) as s:
            made = await call(s, "create_sandbox", image="busybox", memory_mb=256, timeout_s=300)
            assert not made.isError, text(made)
            sid = made.structuredContent["id"]
            assert made.structuredContent["status"] == "running" and sid in text(made)

            listed = await ok(s, "list_sandboxes")
            assert [sb["id"] for sb in listed["sandboxes"]] == [sid]

            ran = await call(s, "run_command", sandbox_id=sid, command="echo out; echo err >&2; exit 3")
            assert not ran.isError
            assert ran.structuredContent["exit_code"] == 3
            assert ran.structuredContent["stdout"] == "out\n" and ran.structuredContent["stderr"] == "err\n"
            assert "exit code: 3" in text(ran) and "out" in text(ran) and "err" in text(ran)
            assert (await ok(s, "run_command", sandbox_id=sid, command="pwd", cwd="/tmp"))[
                "stdout"
            ] == "/tmp\n"

            written = await ok(s, "write_file", sandbox_id=sid, path="/work/notes/hi.txt", content="héllo\n")
            assert written == {"path": "/work/notes/hi.txt", "size": 7}
            read = await ok(s, "read_file", sandbox_id=sid, path="/work/notes/hi.txt")
            assert read["content"] == "héllo\n" and read["size"] == 7
            listed_files = await ok(s, "list_files", sandbox_id=sid, path="/work/notes")
            assert [(e["name"], e["type"], e["size"]) for e in listed_files["entries"]] == [
                ("hi.txt", "file", 7)
            ]
            missing = await call(s, "read_file", sandbox_id=sid, path="/work/nope")
            assert missing.isError and "/work/nope" in text(missing)

            preview = await ok(s, "get_preview_url", sandbox_id=sid, port=8080)
            assert preview["port"] == 8080 and f"8080-{sid}" in preview["url"] and preview["public"] is False
            again = await ok(s, "get_preview_url", sandbox_id=sid, port=8080)
            assert again["url"].split("?")[0] == preview["url"].split("?")[0]
            # A read-only token reads the URL a port has; giving a port one is a change.
            async with connect(sandboxes, read_only) as ro:
                assert (await ok(ro, "get_preview_url", sandbox_id=sid, port=8080))["port"] == 8080
                refused = await call(ro, "get_preview_url", sandbox_id=sid, port=9090)
                assert refused.isError and "sandboxes:write" in text(refused)
                refused = await call(ro, "run_command", sandbox_id=sid, command="id")
                assert refused.isError and "sandboxes:write" in text(refused)

            assert (await ok(s, "pause_sandbox", sandbox_id=sid))["status"] == "paused"
            not_running = await call(s, "run_command", sandbox_id=sid, command="true")
            assert not_running.isError and "paused" in text(not_running)
            assert (await ok(s, "resume_sandbox", sandbox_id=sid))["status"] == "running"
            kept = await ok(s, "read_file", sandbox_id=sid, path="/work/notes/hi.txt")
            assert kept["content"] == "héllo\n"

            deleted = await ok(s, "delete_sandbox", sandbox_id=sid)
            assert deleted["status"] in ("stopping", "deleted")
            left = (await ok(s, "list_sandboxes"))["sandboxes"]
            assert all(sb["status"] in ("stopping", "deleted") for sb in left), left

    anyio.run(main)
    # Recorded as the token's user, through the API's door, as the API records them.
    from runtime.models import ApiToken, AuditEvent

    token = ApiToken.objects.select_related("user").order_by("id").first()  # the team token
    done = AuditEvent.objects.filter(action__in=("sandbox.create", "sandbox.pause", "sandbox.delete"))
    assert {(e.action, e.actor, e.via, e.token) for e in done} == {
        (action, token.user.username, "api", token.prefix)
        for action in ("sandbox.create", "sandbox.pause", "sandbox.delete")
    }


@requires_runsc
def test_another_teams_token_neither_sees_nor_touches_the_sandbox(sandboxes, team_token, other_team_token):
    async def main():
        async with connect(sandboxes, team_token) as mine:
            sid = (await ok(mine, "create_sandbox", image="busybox", memory_mb=256))["id"]
            async with connect(sandboxes, other_team_token) as theirs:
                assert (await ok(theirs, "list_sandboxes"))["sandboxes"] == []
                for name, args in [
                    ("run_command", {"command": "id"}),
                    ("write_file", {"path": "/tmp/x", "content": "x"}),
                    ("read_file", {"path": "/etc/hostname"}),
                    ("list_files", {"path": "/"}),
                    ("get_preview_url", {"port": 80}),
                    ("pause_sandbox", {}),
                    ("resume_sandbox", {}),
                    ("delete_sandbox", {}),
                ]:
                    result = await theirs.call_tool(name, {"sandbox_id": sid, **args})
                    assert result.isError and f"no sandbox {sid!r}" in text(result), (name, text(result))
            # Still there and untouched.
            assert (await ok(mine, "run_command", sandbox_id=sid, command="true"))["exit_code"] == 0
            await ok(mine, "delete_sandbox", sandbox_id=sid)

    anyio.run(main)
