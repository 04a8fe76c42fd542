"""The standard gRPC health service (grpc.health.v1.Health) and server reflection of the coordinator.

Owns `StandardHealth`: Check, Watch and List answered live from ServingEngine.health_status(), so
`grpc_health_probe`, Kubernetes gRPC probes and Envoy see what speedpipe's own Health reports
(SERVING, else NOT_SERVING), for the server as a whole ("") and for `speedpipe.v1.GenerateService`;
another service name is NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch, which stays open), as the
protocol says. Watch polls the state once a second (the state has no change events to wait on).
`enable_reflection` registers server reflection (grpcurl without the .proto). The messages and
stubs come from grpcio-health-checking and grpcio-reflection.
Must not: decide health itself (launcher/serving/serving_engine.py does), or block a Watch stream
after its RPC ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline.speculation.echo import shown
from proto import speedpipe_pb2 as pb

GENERATE_SERVICE = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name
SERVICES = ("", GENERATE_SERVICE)  # the names health answers for: the server as a whole, and Generate
WATCH_POLL_S = 1.0  # how often a Watch stream looks for a change
MAX_WATCHES = 4  # Watch streams at once: each holds a server thread (GrpcServer adds this many)
# RPCs that need no API key, as speedpipe's own Health (probes carry no secrets)
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
_Status = health_pb2.HealthCheckResponse.ServingStatus


class StandardHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health over `status()` -> ("serving" | "not_serving" | "unhealthy", why)."""

    def __init__(self, status: Callable[[], tuple[str, str]], *, poll_s: float = WATCH_POLL_S) -> None:
        self._status, self._poll_s = status, poll_s
        self._watches = threading.BoundedSemaphore(MAX_WATCHES)

    def _current(self) -> int:
        return _Status.SERVING if self._status()[0] == "serving" else _Status.NOT_SERVING

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):  # noqa: N802 - gRPC name
        if request.service not in SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {shown(request.service)}")
        return health_pb2.HealthCheckResponse(status=self._current())

    def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - gRPC name
              context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        if not self._watches.acquire(blocking=False):  # they would take the threads Generate needs
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHES} Watch streams at once; "
                          "use Check")
        known = request.service in SERVICES  # unknown: SERVICE_UNKNOWN, the call kept open
        try:
            last = None
            while context.is_active():
                now = self._current() if known else _Status.SERVICE_UNKNOWN
                if now != last:
                    last = now
                    yield health_pb2.HealthCheckResponse(status=now)
                time.sleep(self._poll_s)
        finally:
            self._watches.release()

    def List(self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext):  # noqa: N802 - gRPC name
        status = health_pb2.HealthCheckResponse(status=self._current())
        return health_pb2.HealthListResponse(statuses=dict.fromkeys(SERVICES, status))


def enable_standard_services(server: grpc.Server, status: Callable[[], tuple[str, str]]) -> None:
    """Add grpc.health.v1.Health and server reflection (v1alpha, which grpcurl uses) to `server`."""
    health_pb2_grpc.add_HealthServicer_to_server(StandardHealth(status), server)
    names = (GENERATE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
