"""The async SDK against the real stack: the same calls as the sync one, awaited."""

from __future__ import annotations

import asyncio
import time

import pytest

from hangar_sdk import AsyncSandbox, ConflictError, NotFoundError
from tests.support import requires_runsc

pytestmark = [requires_runsc]


def test_the_async_sdk_runs_streams_backgrounds_and_moves_files(hangar, tmp_path):
    async def main() -> str:
        async with AsyncSandbox.create(image="busybox", timeout_s=120, env={"WHO": "async"}) as sb:
            assert sb.status == "running"
            r = await sb.exec('echo "hi $WHO"; exit 4')
            assert (r.exit_code, r.stdout) == (4, "hi async\n")

            seen: list[tuple[float, str]] = []
            start = time.monotonic()
            r = await sb.exec(
                "echo a; sleep 1; echo b", on_stdout=lambda s: seen.append((time.monotonic(), s))
            )
            end = time.monotonic()
            assert r.stdout == "a\nb\n" and seen[0][1].startswith("a") and seen[0][0] < end - 0.7, (
                start,
                seen,
            )

            # Two commands at once on one sandbox, from one event loop.
            both = await asyncio.gather(sb.exec("sleep 1; echo one"), sb.exec("sleep 1; echo two"))
            assert [x.stdout for x in both] == ["one\n", "two\n"]

            p = await sb.exec("read line; echo got $line", background=True, stdin_open=True)
            await p.send_stdin("it\n")
            done = await p.wait(timeout=30)
            assert done.exit_code == 0 and done.stdout == "got it\n"
            assert (await p.output()).stdout == "got it\n"
            sleeper = await sb.exec("sleep 300", background=True)
            await sleeper.kill()
            assert (await sleeper.wait(timeout=30)).exit_code != 0

            await sb.files.write("/w/a.txt", b"A")
            assert await sb.files.read("/w/a.txt") == b"A"
            assert [e.name for e in await sb.files.list("/w")] == ["a.txt"]
            (tmp_path / "src" / "d").mkdir(parents=True)
            (tmp_path / "src" / "d" / "f.txt").write_text("f")
            assert await sb.files.upload_dir(tmp_path / "src", "/w/src") == 1
            assert await sb.files.download_dir("/w", tmp_path / "out") == 2
            assert (tmp_path / "out" / "src" / "d" / "f.txt").read_text() == "f"

            assert (await AsyncSandbox.get(sb.id)).status == "running"
            assert sb.id in [s.id for s in await AsyncSandbox.list(status="running")]
            assert (await sb.pause()).status == "paused"
            with pytest.raises(ConflictError) as e:
                await sb.exec("true")
            assert e.value.status == "paused"
            assert (await sb.resume()).status == "running"
            assert "8000" in await sb.preview_url(8000)
            async with await sb.terminal(["sh"]) as term:
                await term.send("echo $((6*7))-mark\n")
                assert b"42-mark" in await term.read_until("42-mark", timeout=20)
                await term.write("exit 3\n")
                while await term.read(timeout=20):
                    pass
                assert term.exit_code == 3
            await sb.keepalive(300)
            sid = sb.id
        # Plain await works too, and the sandbox left by the block is going.
        other = await AsyncSandbox.create(image="busybox", timeout_s=60)
        await other.delete()
        await other.close()
        with pytest.raises(NotFoundError):
            await AsyncSandbox.get("sbnosuchthing")
        return sid

    sid = asyncio.run(main())

    async def status() -> str:
        return (await AsyncSandbox.get(sid)).status

    assert asyncio.run(status()) in ("stopping", "deleted")
