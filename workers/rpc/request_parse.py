"""Parsing of gRPC requests on the server side: an unparsable request is the client's error.

Owns `RequestParseInterceptor` (a server interceptor that hands each handler the raw request bytes
and parses them itself, answering INVALID_ARGUMENT, naming the RPC and its request type, where
grpcio answers INTERNAL "Exception deserializing request!", with a google.rpc.BadRequest naming the
misread fields: workers/rpc/status_details.py) and `misread_fields` (known fields that arrived with
another wire type, which protobuf silently keeps as unknown fields). Used by the
serving GenerateService (launcher/serving/grpc_generate.py) and every stage's StageService
(workers/stage_worker.py). Must not: know which RPCs exist or what they do.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from workers.rpc.status_details import abort_with_details

# ErrorInfo.reason of a request this server cannot parse: the client's stubs come from another .proto
# (a client of another version). A coordinator reads it on a stage's Load as an internal error.
UNPARSABLE_REQUEST = "UNPARSABLE_REQUEST"

# Most misread fields an error names (its message and its BadRequest), each once: a client can send a
# field thousands of times, and a trailer over the client's metadata limit (16 KiB) turns the answer
# into RESOURCE_EXHAUSTED "received metadata size exceeds hard limit".
MAX_NAMED_FIELDS = 8


def misread_fields(message: Message, prefix: str = "") -> list[tuple[str, int]]:
    """Fields of `message` (and of the messages set in it) that arrived with a wire type other than
    the schema's, as (path, field number), e.g. ("temperature", 5), ("prompt_token_ids.ids", 1) or
    ("logprobs[1].top[0].token_id", 1): the paths of google.rpc.BadRequest.FieldViolation.field (an
    item of a repeated message by its index). Protobuf keeps such fields as unknown fields and reads
    the field as unset, so they mean the sender's .proto is not this one."""
    found = [(prefix + message.DESCRIPTOR.fields_by_number[f.field_number].name, f.field_number)
             for f in UnknownFieldSet(message) if f.field_number in message.DESCRIPTOR.fields_by_number]
    for field, value in message.ListFields():
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if field.is_repeated:
                for index, item in enumerate(value):
                    found += misread_fields(item, f"{prefix}{field.name}[{index}].")
            else:
                found += misread_fields(value, f"{prefix}{field.name}.")
    return found


class RequestParseInterceptor(grpc.ServerInterceptor):
    """Answers INVALID_ARGUMENT, naming the RPC and its request type, to a request that is not a valid
    message of that type (bytes that are not protobuf, or a known field with another wire type: a
    client built from another .proto), where grpcio answers INTERNAL "Exception deserializing
    request!" (or silently drops the misread field). Each handler is given the raw bytes and parses
    them with its own deserializer, so the servicers, health, reflection and the API-key check (an
    interceptor placed before this one) stay as they are."""

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _parsing_handler(handler, handler_call_details.method)


def _parsing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` taking raw request bytes (no deserializer) and parsing them itself."""
    parse = handler.request_deserializer
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)  # Message.FromString's class
    what = descriptor.full_name if descriptor is not None else "its request type"

    def parsed(raw: bytes, context: grpc.ServicerContext):
        try:
            request = parse(raw)
            misread = list(dict.fromkeys(misread_fields(request))) if isinstance(request, Message) else []
            more = f" and {len(misread) - MAX_NAMED_FIELDS} more" if len(misread) > MAX_NAMED_FIELDS else ""
            misread = misread[:MAX_NAMED_FIELDS]
            names = ", ".join(f"'{path}' (field {number})" for path, number in misread) + more
            why = f"{names} arrived with another wire type than the schema's" if misread else ""
            violations = [(path, f"field {number} arrived with another wire type than the schema's")
                          for path, number in misread]
        except DecodeError as exc:
            # field "": the request as a whole
            request, why, violations = None, str(exc), [("", f"not a valid {what}: {exc}")]
        if why:
            abort_with_details(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"{method}: the request could not be parsed as {what} ({why}); are the client's "
                               "stubs generated from this server's .proto?", violations=violations,
                               reason=UNPARSABLE_REQUEST, metadata={"method": method, "requestType": what})
        return request

    def each(raws, context: grpc.ServicerContext):
        for raw in raws:
            yield parsed(raw, context)

    kwargs = {"response_serializer": handler.response_serializer}  # no request_deserializer: the raw bytes
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(lambda raw, ctx: handler.unary_unary(parsed(raw, ctx), ctx),
                                                   **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(lambda raw, ctx: handler.unary_stream(parsed(raw, ctx), ctx),
                                                    **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(lambda raws, ctx: handler.stream_unary(each(raws, ctx), ctx),
                                                    **kwargs)
    return grpc.stream_stream_rpc_method_handler(lambda raws, ctx: handler.stream_stream(each(raws, ctx), ctx),
                                                 **kwargs)
