"""A web app in a sandbox, reached through its preview URL: write a page, serve it with
busybox's httpd in the background, ask Hangar for the port's URL and fetch it.

    HANGAR_URL=http://127.0.0.1:8000 HANGAR_TOKEN=hgr_… python web_preview.py

The preview URL is ``http://8000-<sandbox>.<HANGAR_PREVIEW_DOMAIN>/…`` with a signed token. A
browser resolves ``*.localhost`` to this machine; a script may not, so this one sends the
request to HANGAR_URL with the preview's host name, which is all that picks the preview.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

import httpx

from hangar_sdk import Sandbox


def fetch_preview(url: str) -> httpx.Response:
    parts = urlsplit(url)
    server = os.environ["HANGAR_URL"]
    # A private preview's link sets a cookie and redirects to the page: follow it, keep the cookie.
    with httpx.Client(
        base_url=server, headers={"Host": parts.netloc}, follow_redirects=True, timeout=30
    ) as c:
        return c.get(f"{parts.path or '/'}?{parts.query}")


def main() -> None:
    with Sandbox.create(image="busybox", timeout_s=300, memory_mb=256) as sb:
        sb.files.write("/www/index.html", "<h1>hello from a sandbox</h1>\n")
        server = sb.exec("httpd -f -p 8000 -h /www", background=True)
        for _ in range(100):  # until it listens
            if sb.exec("wget -q -O /dev/null http://127.0.0.1:8000/").exit_code == 0:
                break
            time.sleep(0.1)
        url = sb.preview_url(8000)
        print("preview URL:", url)
        page = fetch_preview(url)
        print(page.status_code, page.text, end="")
        server.kill()


if __name__ == "__main__":
    main()
