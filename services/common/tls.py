"""TLS, and mutual TLS, on the gRPC ports: the same settings in every service.

A service serves TLS when `GRPC_TLS_CERT` and `GRPC_TLS_KEY` name its
certificate and key (PEM); with `GRPC_TLS_CLIENT_CA` it also requires every
client to present a certificate that CA signed (mutual TLS, for the calls
between services). It calls other services over TLS when `GRPC_TLS_CA` names
the CA their certificates chain to, presenting its own certificate when it
has one (so one certificate per service serves both directions).
`GRPC_TLS_SERVER_NAME` checks the servers' certificates for that name
instead of the host called (for certificates issued to a service name
reached by address).

`python -m services.common.tls make-dev-certs DIR [NAME ...]` writes a
private CA and a certificate for each name (valid for the name, `localhost`
and 127.0.0.1), for trying mutual TLS and for the compose file; a
deployment uses its own CA.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.settings import EnvReader


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients must be signed by (mTLS)."""

    certificate: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ClientTls:
    """The CA servers are checked against, and the certificate shown to them (mTLS)."""

    ca: bytes = field(repr=False)
    certificate: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.private_key, certificate_chain=self.certificate
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class TlsSettings:
    server: ServerTls | None = None
    client: ClientTls | None = None

    def describe(self) -> str:
        """For start-up lines: which of TLS and mTLS are on (nothing secret)."""
        if self.server is None:
            return "plaintext"
        return "mutual TLS" if self.server.client_ca is not None else "TLS"


def read_tls(env: EnvReader) -> TlsSettings:
    """The TLS settings (none: plaintext), every problem reported through `env`."""
    cert = _read(env, "GRPC_TLS_CERT")
    key = _read(env, "GRPC_TLS_KEY")
    client_ca = _read(env, "GRPC_TLS_CLIENT_CA")
    ca = _read(env, "GRPC_TLS_CA")
    server_name = env.text("GRPC_TLS_SERVER_NAME", "")
    if (cert is None) != (key is None):
        env.problem("GRPC_TLS_CERT and GRPC_TLS_KEY: set both or neither")
        cert = key = None
    if client_ca is not None and cert is None:
        env.problem("GRPC_TLS_CLIENT_CA: mutual TLS needs GRPC_TLS_CERT and GRPC_TLS_KEY as well")
    server = ServerTls(cert, key, client_ca) if cert is not None and key is not None else None
    client = ClientTls(ca, cert, key, server_name) if ca is not None else None
    if server_name and client is None:
        env.problem("GRPC_TLS_SERVER_NAME: only used with GRPC_TLS_CA")
    return TlsSettings(server=server, client=client)


def _read(env: EnvReader, name: str) -> bytes | None:
    path = env.optional(name)
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        env.problem(f"{name}: cannot read {path}: {error.strerror}")
        return None


def make_dev_certs(directory: Path, names: Sequence[str], *, days: int = 825) -> None:
    """A private CA (`ca.pem`) and, for each name, `<name>.pem` and
    `<name>-key.pem` (mode 0600), valid for the name, localhost and 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, data: bytes, *, secret: bool = False) -> None:
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Agent IM development CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        alternatives: list[x509.GeneralName] = [x509.DNSName(name), x509.DNSName("localhost")]
        alternatives.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write(f"{name}-key.pem", private, secret=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.tls", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    dev = commands.add_parser("make-dev-certs", help="a private CA and a certificate per name")
    dev.add_argument("directory", type=Path)
    dev.add_argument("names", nargs="*", default=["im", "runtime", "memory", "gateway"])
    dev.add_argument("--keep", action="store_true", help="do nothing if the directory already has ca.pem")
    args = parser.parse_args(argv)
    if args.keep and (args.directory / "ca.pem").exists():
        print(f"{args.directory} already has certificates")
        return 0
    make_dev_certs(args.directory, args.names)
    print(f"wrote a CA and certificates for {', '.join(args.names)} to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
