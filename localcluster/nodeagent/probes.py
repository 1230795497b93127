"""HTTP, TCP and exec probes against a pod, as the kubelet runs them."""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any


def _port(value: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"named port {value!r} not found")


def run_probe(
    probe: Mapping[str, Any], container: Mapping[str, Any], pod_ip: str, netns: str
) -> bool:
    """Run one probe once; return whether it succeeded."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host = spec.get("host") or pod_ip
            scheme = spec.get("scheme", "HTTP").lower()
            url = f"{scheme}://{host}:{_port(spec['port'], container)}{spec.get('path', '/')}"
            request = urllib.request.Request(url)
            for header in spec.get("httpHeaders") or []:
                request.add_header(header["name"], header["value"])
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return 200 <= int(response.status) < 400
            except urllib.error.HTTPError as error:
                return 200 <= error.code < 400
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            host = spec.get("host") or pod_ip
            with socket.create_connection((host, _port(spec["port"], container)), timeout):
                return True
        if "exec" in probe:
            command = probe["exec"]["command"]
            proc = subprocess.run(
                ["ip", "netns", "exec", netns, *command],
                capture_output=True,
                timeout=timeout,
                check=False,
            )
            return proc.returncode == 0
        if "grpc" in probe:
            return False
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
    return True
