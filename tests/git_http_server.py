"""A private git repository over HTTP for the tests: git's smart HTTP protocol (``git
http-backend`` as CGI) behind HTTP basic authentication, as a forge serves a private
repository to a token. Run in the tests' ``world`` namespace by the ``private_git_server``
fixture; stdlib only.

    python git_http_server.py ROOT ADDRESS PORT USER PASSWORD
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


def handler(root: str, user: str, password: str) -> type[BaseHTTPRequestHandler]:
    wanted = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Git(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _cgi(self) -> None:
            if self.headers.get("Authorization") != wanted:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="git"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": root, "GIT_HTTP_EXPORT_ALL": "1",
                "REQUEST_METHOD": self.command, "PATH_INFO": parts.path, "QUERY_STRING": parts.query,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(length),
                "REMOTE_USER": user, "REMOTE_ADDR": self.client_address[0],
                "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
            }  # fmt: skip
            out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
            head, _, payload = out.partition(b"\r\n\r\n")
            if not _:
                head, _, payload = out.partition(b"\n\n")
            status = 200
            headers = []
            for line in head.decode("latin-1").splitlines():
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.strip().split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _cgi

    return Git


def main() -> None:
    root, address, port, user, password = sys.argv[1:6]
    ThreadingHTTPServer((address, int(port)), handler(root, user, password)).serve_forever()


if __name__ == "__main__":
    main()
