"""The node agent's kubelet-style HTTPS endpoint: container logs for `kubectl logs`.

The API server proxies `pods/log` to `https://<node InternalIP>:10250/containerLogs/
<namespace>/<pod>/<container>`; it presents a client certificate signed by the
cluster CA, which this server requires. `follow`, `tailLines` and `limitBytes`
are honoured; a container's log spans its restarts (no `--previous`).
"""

from __future__ import annotations

import http.server
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def tail(data: bytes, lines: int | None) -> bytes:
    """Return the last `lines` lines of `data` (all of it when None)."""
    if lines is None:
        return data
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def serve_logs(
    address: tuple[str, int],
    logs: Path,
    pki: Path,
    alive: Callable[[str, str], bool],
) -> http.server.ThreadingHTTPServer:
    """Start the HTTPS log server in a thread; `alive(ns, pod)` ends `follow` streams."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404)
                return
            _, namespace, pod, container = parts
            query = urllib.parse.parse_qs(url.query)
            path = logs / f"{namespace}_{pod}_{container}.log"
            if not path.exists():
                self.send_error(404, f"no log for {namespace}/{pod}/{container}")
                return
            lines = int(query["tailLines"][0]) if "tailLines" in query else None
            limit = int(query["limitBytes"][0]) if "limitBytes" in query else None
            follow = query.get("follow", ["false"])[0] == "true"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            with path.open("rb") as source:
                data = tail(source.read(), lines)
                if limit is not None:
                    data = data[:limit]
                self.wfile.write(data)
                self.wfile.flush()
                while follow and alive(namespace, pod):
                    chunk = source.read(65536)
                    if chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    else:
                        time.sleep(0.2)  # polling a growing file

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(address, Handler)
    server.daemon_threads = True
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="logs", daemon=True).start()
    return server
