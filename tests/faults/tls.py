"""A TLS front for the Temporal dev server (which speaks only plaintext), for the tests of
TLS, mTLS and API-key connections: a gRPC proxy that terminates TLS, optionally requires a
client certificate signed by its CA, records what each call presented, and forwards the call
unchanged to the dev server. Certificates come from the ``openssl`` command."""

from __future__ import annotations

import shutil
import subprocess
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from outbox_bridge.dev.embedded import free_port

# Metadata that gRPC sets itself and refuses from the application.
_RESERVED = ("user-agent", "grpc-", ":")


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=outbox-bridge test CA", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=outbox-{name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")  # fmt: skip
    return Certificates(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "client.pem",
        directory / "client.key",
    )


@dataclass
class Seen:
    """What one call presented to the proxy."""

    method: str
    authorization: str | None
    client_common_name: str | None


@dataclass
class TlsProxy:
    target: str
    certificates: Certificates
    require_client_certificate: bool = False
    seen: list[Seen] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    _server: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> TlsProxy:
        upstream = grpc.insecure_channel(self.target)
        proxy = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                method = details.method
                forward = upstream.unary_unary(method)

                def call(request: bytes, context: grpc.ServicerContext) -> Any:
                    metadata = list(context.invocation_metadata())
                    auth = context.auth_context().get("x509_common_name")
                    with proxy._lock:
                        proxy.seen.append(
                            Seen(
                                method,
                                dict(metadata).get("authorization"),
                                auth[0].decode() if auth else None,
                            )
                        )
                    kept = [(k, v) for k, v in metadata if not k.startswith(_RESERVED)]
                    try:
                        return forward(request, metadata=kept, timeout=context.time_remaining())
                    except grpc.RpcError as exc:
                        context.abort(exc.code(), exc.details())

                return grpc.unary_unary_rpc_method_handler(call)

        credentials = grpc.ssl_server_credentials(
            [
                (
                    self.certificates.server_key.read_bytes(),
                    self.certificates.server_cert.read_bytes(),
                )
            ],
            root_certificates=self.certificates.ca.read_bytes(),
            require_client_auth=self.require_client_certificate,
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        self._server.add_generic_rpc_handlers([Forward()])
        self._server.add_secure_port(self.address, credentials)
        self._server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.stop(grace=None)

    def methods(self) -> set[str]:
        with self._lock:
            return {s.method.rsplit("/", 1)[-1] for s in self.seen}
