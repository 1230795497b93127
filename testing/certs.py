"""Throw-away certificates for TLS tests, made with the `openssl` command (as the local
cluster's PKI is): a CA, and leaf certificates it signs for loopback."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass(frozen=True)
class Leaf:
    """A certificate and its key (PEM files)."""

    cert: Path
    key: Path


class TestCA:
    """A CA in `folder` (ca.crt, ca.key) that signs server and client certificates."""

    __test__ = False  # not a pytest class

    def __init__(self, folder: Path, name: str = "TwinMQ test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.cert, self.key = folder / "ca.crt", folder / "ca.key"
        _openssl("genrsa", "-out", "ca.key", "2048", cwd=folder)
        _openssl("req", "-x509", "-new", "-key", "ca.key", "-days", "2", "-subj", f"/CN={name}",
                 "-out", "ca.crt", cwd=folder)  # fmt: skip

    def issue(self, name: str, *, client: bool = False, peer: bool = False, days: int = 2) -> Leaf:
        """A leaf for `name`: a server certificate for localhost / 127.0.0.1, a client one,
        or (`peer`) one for both ends of a mutual-TLS link that also names `name` (a
        replication peer: it serves as the active and connects as the passive)."""
        if peer:
            extensions = (
                "extendedKeyUsage=serverAuth,clientAuth\n"
                f"subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:{name}\n"
            )
        elif client:
            extensions = "extendedKeyUsage=clientAuth\n"
        else:
            extensions = "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
        ext = self.folder / f"{name}.ext"
        ext.write_text(extensions)
        _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=self.folder)
        _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}",
                 "-out", f"{name}.csr", cwd=self.folder)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", str(days), "-extfile", ext.name,
                 "-out", f"{name}.crt", cwd=self.folder)  # fmt: skip
        return Leaf(self.folder / f"{name}.crt", self.folder / f"{name}.key")

    def sign(self, label: str, subject: x509.Name, extensions: list[x509.ExtensionType]) -> Leaf:
        """A leaf this CA signs for exactly `subject` with exactly `extensions` (non-critical),
        valid for a day: for certificates `issue` cannot make (several names, crafted
        subjects, odd usages)."""
        key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        assert isinstance(ca_key, rsa.RSAPrivateKey)  # made by `openssl genrsa`
        now = datetime.now(UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
        )
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        leaf = Leaf(self.folder / f"{label}.crt", self.folder / f"{label}.key")
        leaf.cert.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(
            serialization.Encoding.PEM))  # fmt: skip
        leaf.key.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))  # fmt: skip
        return leaf
