"""Authentication of gRPC services: the per-session control-plane secret and the serving API key.

Owns the shared-secret check on both sides of a gRPC connection: `SecretCheckInterceptor` (a server
interceptor that answers UNAUTHENTICATED, with an ErrorInfo CREDENTIALS_MISSING or CREDENTIALS_INVALID,
to every call whose metadata lacks the expected value; used
by every stage's StageService with the session secret, and by the GenerateService with `--api-key`),
`with_secret` (a client channel that adds the value to every call), how the launcher creates a
session secret and hands it to stage processes (`SECRET_ENV`, read once by the worker at start-up),
and the optional TLS of the control plane (`TlsFiles`, `control_channel`).
Must not: know which RPCs exist or what they do.

[Note: control-plane secret]
Each pipeline session draws a fresh 256-bit secret (`new_secret`). Local stage processes get it in
their environment (never on the command line, which every user can read with `ps`; a process's
environment is readable only by its own user and root) and drop it from `os.environ` at once;
multi-node members read it from the launch store of node 0; the coordinator sends it as call
metadata `x-speedpipe-control-secret` on every control call. A stage compares it in constant time
(`hmac.compare_digest`). Without TLS the secret crosses the network in clear text: on loopback
that is fine, across nodes use `--tls-cert/--tls-key` or a private network.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from workers.rpc.status_details import abort_with_details

SECRET_ENV = "SPEEDPIPE_CONTROL_SECRET"
SECRET_METADATA_KEY = "x-speedpipe-control-secret"
API_KEY_METADATA_KEY = "authorization"  # "Bearer KEY", as the HTTP front end (and vLLM) expect
API_KEY_ENV = "SPEEDPIPE_API_KEY"  # `serve`'s --api-key when the flag is not given
# Largest stage control-plane message (both ends): a trained predictor travels inside LoadStageRequest,
# and one H x H map of a 1.5B model (H = 1536) is 4.7 MB in float16, past gRPC's 4 MiB default.
MAX_CONTROL_MESSAGE_BYTES = 64 << 20
CONTROL_GRPC_OPTIONS = (("grpc.max_receive_message_length", MAX_CONTROL_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_CONTROL_MESSAGE_BYTES))


def new_secret() -> str:
    """A fresh session secret: 43 url-safe characters (256 random bits)."""
    return secrets.token_urlsafe(32)


def take_secret_from_env() -> str | None:
    """The session secret handed to this worker process in `SECRET_ENV`, removed from os.environ
    (so that no child of the worker inherits it); None when it was not set."""
    return os.environ.pop(SECRET_ENV, None) or None


def secret_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented secret with the expected one."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class SecretCheckInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata `key` is not `expected` with UNAUTHENTICATED.

    expected: the secret (for `authorization` metadata: the whole value, e.g. "Bearer KEY").
    exempt: full method names (`/speedpipe.v1.GenerateService/Health`) served without the check.
    what: how the refusal names the missing credential, e.g. "the control-plane secret".
    """

    def __init__(self, *, key: str, expected: str, what: str, exempt: Iterable[str] = ()) -> None:
        if not expected:
            raise ValueError(f"{what} must be a non-empty string")
        self._key, self._expected, self._what = key, expected, what
        self._exempt = frozenset(exempt)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(self._key)
        if secret_matches(given, self._expected):
            return handler
        reason = "CREDENTIALS_MISSING" if given is None else "CREDENTIALS_INVALID"
        return _refusal(handler, f"{handler_call_details.method}: missing or wrong {self._what}", reason,
                        {"metadataKey": self._key})


def _refusal(handler: grpc.RpcMethodHandler, message: str, reason: str,
             metadata: dict[str, str]) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED `message` and an
    ErrorInfo `reason` (CREDENTIALS_MISSING: no such metadata; CREDENTIALS_INVALID: a wrong value) with
    `metadata` (the metadata key the server reads), as workers/rpc/status_details.py gives every error."""
    def deny(request, context):
        abort_with_details(context, grpc.StatusCode.UNAUTHENTICATED, message, reason=reason, metadata=metadata)

    def deny_stream(request, context):
        abort_with_details(context, grpc.StatusCode.UNAUTHENTICATED, message, reason=reason, metadata=metadata)
        yield  # pragma: no cover - abort raises

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                            "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: str, value: str) -> None:
        self._pair = (key, value)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._pair], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def with_secret(channel: grpc.Channel, secret: str | None, *, key: str = SECRET_METADATA_KEY) -> grpc.Channel:
    """`channel` sending `secret` as metadata `key` on every call (`channel` itself when secret is None)."""
    return channel if secret is None else grpc.intercept_channel(channel, _AddMetadata(key, secret))


TLS_CERT_ENV = "SPEEDPIPE_TLS_CERT"
TLS_KEY_ENV = "SPEEDPIPE_TLS_KEY"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """PEM files of the control plane's TLS (`--tls-cert`, `--tls-key`): every stage serves with
    this certificate and key, the coordinator trusts exactly this certificate (so it must name
    every stage's host: subjectAltName IP or DNS entries). Raises ValueError naming the flag for a
    missing or unreadable file, or one that is not PEM."""

    cert_file: str
    key_file: str

    def __post_init__(self) -> None:
        for flag, path, marker in (("--tls-cert", self.cert_file, b"-----BEGIN CERTIFICATE"),
                                   ("--tls-key", self.key_file, b"PRIVATE KEY-----")):
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
            if marker not in data:
                raise ValueError(f"{flag} {path}: not a PEM {'certificate' if flag == '--tls-cert' else 'private key'}")

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a stage worker (`from_env` there)."""
        return {TLS_CERT_ENV: str(Path(self.cert_file).resolve()), TLS_KEY_ENV: str(Path(self.key_file).resolve())}

    @classmethod
    def from_env(cls) -> TlsFiles | None:
        """The files named by SPEEDPIPE_TLS_CERT / SPEEDPIPE_TLS_KEY (both or neither), else None."""
        cert, key = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
        if not cert and not key:
            return None
        if not cert or not key:
            raise ValueError(f"{TLS_CERT_ENV} and {TLS_KEY_ENV} must be set together")
        return cls(cert_file=cert, key_file=key)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=Path(self.cert_file).read_bytes())


def control_channel(address: str, *, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to a stage's control plane: TLS trusting `tls.cert_file` when given, else plain
    (messages up to MAX_CONTROL_MESSAGE_BYTES)."""
    options = list(CONTROL_GRPC_OPTIONS)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)
