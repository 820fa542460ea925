"""Fixtures for tests of what a node keeps on its host: a local registry to pull images from."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.oci_images import Registry
from tests.support import free_port

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    assert os.path.exists(binary), "apt-get install docker-registry"
    assert shutil.which("skopeo"), "apt-get install skopeo"
    base = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = base / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {base / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = base / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v2/"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {log.read_text(errors='replace')}")
            try:
                with _NO_PROXY.open(url, timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"docker-registry did not answer on {url}: {log.read_text(errors='replace')}"
                )
            time.sleep(0.1)
        yield Registry(host=f"127.0.0.1:{port}", process=proc, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
