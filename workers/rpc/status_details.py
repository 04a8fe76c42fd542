"""Machine-readable details of a gRPC error (Google's AIP-193 "rich error model").

Owns `abort_with_details`: it ends an RPC with the status code and the one-line message it always had,
plus a `google.rpc.Status` in the `grpc-status-details-bin` trailer carrying `google.rpc.BadRequest`
(which request fields are wrong and why), `google.rpc.ErrorInfo` (a stable `reason` in the "speedpipe"
domain, with metadata) and `google.rpc.RetryInfo` (how long to wait before retrying) as they apply;
with a RetryInfo, also the `grpc-retry-pushback-ms` trailer of the same delay, which gRPC's own
client-side retry policy reads (gRFC A6), so that a client with one backs off without reading details.
Clients read them with `grpc_status.rpc_status.from_call(err)` (README, gRPC section; `error_reason`
reads the ErrorInfo's reason, as the coordinator does of a stage's Load); clients that do not still see
the code and the message. Used by the serving GenerateService
(launcher/serving/grpc_generate.py), the request-parse interceptor (workers/rpc/request_parse.py) and
the coordinator's Load (launcher/coordinator/stage_control.py, `error_reason`).
Must not: decide which error an RPC gets (the callers do).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "speedpipe"  # ErrorInfo.domain of every error speedpipe's servers give
# google/rpc/error_details.proto: a reason is UPPER_SNAKE_CASE (at most 63 characters); a metadata key
# matches [a-z][a-zA-Z0-9-_]+ "but should ideally be lowerCamelCase" (at most 64): speedpipe's are.
REASON = re.compile(r"[A-Z][A-Z0-9_]{0,61}[A-Z0-9]")
METADATA_KEY = re.compile(r"[a-z][a-zA-Z0-9]{1,63}")
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRFC A6: the server's back-off before the next attempt, in ms


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """The grpc.Status that `abort_with_status` takes (grpc_status.rpc_status.to_status's own shape)."""


def status_with_details(
    code: grpc.StatusCode,
    message: str,
    *,
    violations: Sequence[tuple[str, str]] = (),
    reason: str | None = None,
    metadata: Mapping[str, str] | None = None,
    retry_delay_s: float | None = None,
) -> status_pb2.Status:
    """A google.rpc.Status: `code`, `message`, and as details a BadRequest with one FieldViolation per
    (field, description) of `violations` (field "" = the request as a whole), an ErrorInfo when
    `reason` is given (UPPER_SNAKE_CASE, domain DOMAIN, string `metadata` under lowerCamelCase keys) and
    a RetryInfo when `retry_delay_s` (seconds, >= 0) is given."""
    assert reason is None or REASON.fullmatch(reason), f"ErrorInfo reason {reason!r} is not UPPER_SNAKE_CASE"
    assert all(map(METADATA_KEY.fullmatch, metadata or {})), f"ErrorInfo keys {list(metadata)} are not lowerCamelCase"
    details = []
    if violations:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                    for field, description in violations
                ]
            )
        )
    if reason is not None:
        info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata or {}))
        details.append(info)
    if retry_delay_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(retry_delay_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return status_pb2.Status(code=code.value[0], message=message, details=packed)


def abort_with_details(
    context: grpc.ServicerContext, code: grpc.StatusCode, message: str, **details
) -> NoReturn:
    """End the RPC as `context.abort(code, message)` does (raises), with the `status_with_details`
    of `details` in the `grpc-status-details-bin` trailer, and, when they have a `retry_delay_s`, that
    delay in whole milliseconds in the RETRY_PUSHBACK_KEY trailer (gRFC A6: a retry policy waits that
    long before its next attempt, instead of its own back-off)."""
    status = rpc_status.to_status(status_with_details(code, message, **details))
    trailer = tuple(status.trailing_metadata)
    if details.get("retry_delay_s") is not None:
        trailer += ((RETRY_PUSHBACK_KEY, str(round(details["retry_delay_s"] * 1000))),)
    context.abort_with_status(_Status(status.code, status.details, trailer))
    raise AssertionError("abort_with_status returned")  # grpc raises; never reached


def error_reason(exc: BaseException) -> str:
    """The google.rpc.ErrorInfo reason a failed RPC carries in its status details (`abort_with_details`'s),
    or "" for none (an error without details, or not an RPC's)."""
    try:
        status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    except ValueError:  # details whose code or message disagree with the call's
        return ""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""
