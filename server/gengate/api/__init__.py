"""The gRPC layer: protobuf in and out, status mapping, authentication, health, tracing."""

# Method-name prefixes of the services anyone may call: health (load balancers, probes) and
# reflection (tools). They are not authenticated, traced, or counted in flight while draining.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
