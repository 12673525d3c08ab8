/** Client spans and W3C trace context in gRPC metadata, as a connect interceptor. */
import {
  context,

  SpanKind,
  SpanStatusCode,
  trace,
  type Span,
  type TextMapPropagator,
  type TracerProvider,
} from "@opentelemetry/api";
import { CompositePropagator, W3CBaggagePropagator, W3CTraceContextPropagator } from "@opentelemetry/core";
import { ConnectError, type Interceptor, type StreamResponse } from "@connectrpc/connect";

export interface TracingOptions {
  /** Where client spans go; default: the globally registered provider. */
  tracerProvider?: TracerProvider;
  /** How trace context goes into metadata; default: W3C traceparent + baggage. */
  propagator?: TextMapPropagator;
}

const headerSetter = {
  set(carrier: Headers, key: string, value: string): void {
    carrier.set(key, value);
  },
};

function endSpan(span: Span, error: unknown): void {
  if (error === undefined) {
    span.setAttribute("rpc.grpc.status_code", 0);
  } else {
    const code = ConnectError.from(error).code;
    span.setAttribute("rpc.grpc.status_code", code);
    span.setStatus({ code: SpanStatusCode.ERROR, message: ConnectError.from(error).rawMessage });
  }
  span.end();
}

async function* traced<T>(span: Span, messages: AsyncIterable<T>): AsyncIterable<T> {
  let error: unknown;
  try {
    yield* messages;
  } catch (e) {
    error = e;
    throw e;
  } finally {
    endSpan(span, error);
  }
}

/**
 * Makes one CLIENT span per call (named like the Go and Python instrumentations:
 * "gengate.v1.GenerationService/Generate") and injects its context into the request headers.
 */
export function tracingInterceptor(options: TracingOptions = {}): Interceptor {
  const propagator =
    options.propagator ??
    new CompositePropagator({
      propagators: [new W3CTraceContextPropagator(), new W3CBaggagePropagator()],
    });
  return (next) => async (req) => {
    const tracer = (options.tracerProvider ?? trace.getTracerProvider()).getTracer("@gengate/client");
    const service = req.service.typeName;
    const span = tracer.startSpan(`${service}/${req.method.name}`, {
      kind: SpanKind.CLIENT,
      attributes: { "rpc.system": "grpc", "rpc.service": service, "rpc.method": req.method.name },
    });
    const ctx = trace.setSpan(context.active(), span);
    propagator.inject(ctx, req.header, headerSetter);
    let res;
    try {
      res = await context.with(ctx, () => next(req));
    } catch (e) {
      endSpan(span, e);
      throw e;
    }
    if (!res.stream) {
      endSpan(span, undefined);
      return res;
    }
    const stream: StreamResponse = { ...res, message: traced(span, res.message) };
    return stream;
  };
}

