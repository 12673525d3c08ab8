"""Container health check: exits 0 when gengate answers grpc.health.v1 Check with SERVING.

Used by the image's HEALTHCHECK (Docker, Compose, Nomad); Kubernetes uses its native `grpc:`
probe instead. Only grpcio and grpcio-health-checking, which the server already depends on.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    """True when `service` at `address` reports SERVING within `timeout` seconds."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return False
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(
            f"unhealthy: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr
        )
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
