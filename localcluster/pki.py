"""Certificates and keys for the local control plane, made with the `openssl` command."""

from __future__ import annotations

import base64
import secrets
import subprocess
from pathlib import Path
from typing import Any

from twinmq.localcluster.layout import GATEWAY_IP, KUBERNETES_SERVICE_IP, NODE_NAME, Layout

ADMIN_USER = "twinmq-admin"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def ensure_pki(layout: Layout) -> None:
    """Create the CA, the API server's serving certificate, SA keys and admin token if missing."""
    pki = layout.pki
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _openssl("genrsa", "-out", "ca.key", "2048", cwd=pki)
        _openssl(
            "req",
            "-x509",
            "-new",
            "-nodes",
            "-key",
            "ca.key",
            "-sha256",
            "-days",
            "3650",
            "-subj",
            "/CN=twinmq-local-ca",
            "-out",
            "ca.crt",
            cwd=pki,
        )
    _signed(pki, "kubelet", "/CN=twinmq-node", f"subjectAltName=IP:{GATEWAY_IP}", "serverAuth")
    # The real node's kubelet (TWINMQ_NODE=kubelet) registers with this; the Node authorizer
    # scopes it to its own pods' objects.
    _signed(pki, "node-client", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "", "clientAuth")
    _signed(pki, "apiserver-kubelet-client", "/CN=kube-apiserver-kubelet-client", "", "clientAuth")
    if not (pki / "apiserver.crt").exists():
        sans = ",".join(
            [
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
                "DNS:localhost",
                "IP:127.0.0.1",
                f"IP:{GATEWAY_IP}",
                f"IP:{KUBERNETES_SERVICE_IP}",
            ]
        )
        (pki / "apiserver.ext").write_text(
            f"subjectAltName={sans}\nkeyUsage=digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
        )
        _openssl("genrsa", "-out", "apiserver.key", "2048", cwd=pki)
        _openssl(
            "req",
            "-new",
            "-key",
            "apiserver.key",
            "-subj",
            "/CN=kube-apiserver",
            "-out",
            "apiserver.csr",
            cwd=pki,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-sha256",
            "-extfile",
            "apiserver.ext",
            "-out",
            "apiserver.crt",
            cwd=pki,
        )
    if not (pki / "sa.key").exists():
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    token_file = pki / "tokens.csv"
    if not token_file.exists():
        token = secrets.token_hex(24)
        token_file.write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        token_file.chmod(0o600)


def _signed(pki: Path, name: str, subject: str, extension: str, usage: str) -> None:
    """Make `<name>.key` and `<name>.crt` signed by the cluster CA, unless they exist."""
    if (pki / f"{name}.crt").exists():
        return
    ext = f"{extension}\n" if extension else ""
    (pki / f"{name}.ext").write_text(
        f"{ext}keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
    )
    _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", f"{name}.ext",
        "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip


def admin_token(layout: Layout) -> str:
    """Return the static admin bearer token (in group system:masters)."""
    return (layout.pki / "tokens.csv").read_text().split(",", 1)[0]


def kubeconfig(
    layout: Layout, server: str, user: str, credentials: dict[str, str]
) -> dict[str, Any]:
    """Return a kubeconfig for `server` (the cluster CA embedded) as `user` with
    `credentials`: a token, or client-certificate and client-key paths."""
    ca = base64.b64encode((layout.pki / "ca.crt").read_bytes()).decode()
    name = "twinmq-local"
    cluster = {"server": server, "certificate-authority-data": ca}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user}}],
        "current-context": name,
    }
