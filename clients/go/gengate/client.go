// Package gengate is a small typed client for the gengate.v1 GenerationService: text,
// streams, batches and structured output decoded into Go types, over one gRPC connection;
// and for the BatchJobService (Client.BatchJobs): durable jobs that run on the server.
//
// The generated API lives in github.com/gengate/gengate/clients/go/gen/gengate/v1; this
// package re-exports its request and response types and adds TLS and auth options, typed
// errors, iterators for streams and OpenTelemetry trace propagation.
package gengate

import (
	"context"
	"crypto/tls"
	"iter"
	"slices"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// The generated types a caller works with, under shorter names.
type (
	Request       = gengatev1.GenerateRequest
	Response      = gengatev1.GenerateResponse
	Frame         = gengatev1.GenerateStreamResponse
	ModelInfo     = gengatev1.ModelInfo
	Generation    = gengatev1.Generation
	Sampling      = gengatev1.SamplingParams
	Stopping      = gengatev1.StoppingCriteria
	Structured    = gengatev1.StructuredOutput
	BatchResponse = gengatev1.BatchGenerateResponse
)

// Client talks to one gengate server. It is safe for concurrent use; Close releases it.
type Client struct {
	conn *grpc.ClientConn
	rpc  gengatev1.GenerationServiceClient
	jobs *BatchJobs
	md   metadata.MD
}

type dialConfig struct {
	tls         *tls.Config
	insecure    bool
	md          metadata.MD
	tracer      trace.TracerProvider
	propagators propagation.TextMapPropagator
	noTracing   bool
	retry       RetryPolicy
	dialOptions []grpc.DialOption
}

// Option configures Dial.
type Option func(*dialConfig)

// WithTLS uses TLS with the given configuration (nil: the system roots).
func WithTLS(cfg *tls.Config) Option {
	return func(c *dialConfig) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		c.tls, c.insecure = cfg, false
	}
}

// WithInsecure uses plaintext, for a local server or one behind a mesh that terminates TLS.
func WithInsecure() Option { return func(c *dialConfig) { c.insecure, c.tls = true, nil } }

// WithBearerToken sends "authorization: Bearer <token>" on every call.
func WithBearerToken(token string) Option {
	return WithMetadata("authorization", "Bearer "+token)
}

// WithMetadata sends a gRPC metadata entry on every call.
func WithMetadata(key, value string) Option {
	return func(c *dialConfig) { c.md.Append(key, value) }
}

// WithTracerProvider makes client spans with tp instead of the global provider.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *dialConfig) { c.tracer = tp }
}

// WithPropagators sets how trace context goes into metadata (default: W3C traceparent and
// baggage).
func WithPropagators(p propagation.TextMapPropagator) Option {
	return func(c *dialConfig) { c.propagators = p }
}

// WithoutTracing turns the OpenTelemetry stats handler off.
func WithoutTracing() Option { return func(c *dialConfig) { c.noTracing = true } }

// WithDialOptions passes raw grpc.DialOptions (load balancing, keepalive, interceptors). They
// come after the client's own, so a grpc.WithDefaultServiceConfig here replaces the retry
// policy's service config.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *dialConfig) { c.dialOptions = append(c.dialOptions, opts...) }
}

// Dial connects lazily to addr ("host:port" or any gRPC target). TLS with the system roots
// is the default; pass WithInsecure for plaintext. Calls are retried as DefaultRetryPolicy
// says unless WithRetry or WithMaxRetries changes it.
func Dial(addr string, opts ...Option) (*Client, error) {
	cfg := dialConfig{md: metadata.MD{}, retry: DefaultRetryPolicy}
	cfg.retry.RetryableCodes = slices.Clone(DefaultRetryPolicy.RetryableCodes)
	for _, opt := range opts {
		opt(&cfg)
	}
	retry, err := cfg.retry.withDefaults()
	if err != nil {
		return nil, err
	}
	var creds credentials.TransportCredentials
	switch {
	case cfg.insecure:
		creds = insecure.NewCredentials()
	case cfg.tls != nil:
		creds = credentials.NewTLS(cfg.tls)
	default:
		creds = credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12})
	}
	dialOpts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if !cfg.noTracing {
		prop := cfg.propagators
		if prop == nil {
			prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
		}
		handlerOpts := []otelgrpc.Option{otelgrpc.WithPropagators(prop)}
		if cfg.tracer != nil {
			handlerOpts = append(handlerOpts, otelgrpc.WithTracerProvider(cfg.tracer))
		}
		dialOpts = append(dialOpts, grpc.WithStatsHandler(otelgrpc.NewClientHandler(handlerOpts...)))
	}
	if sc := retry.serviceConfig(); sc != "" {
		dialOpts = append(dialOpts, grpc.WithDefaultServiceConfig(sc))
	}
	conn, err := grpc.NewClient(addr, append(dialOpts, cfg.dialOptions...)...)
	if err != nil {
		return nil, err
	}
	c := &Client{conn: conn, rpc: gengatev1.NewGenerationServiceClient(conn), md: cfg.md}
	c.jobs = &BatchJobs{c: c, rpc: gengatev1.NewBatchJobServiceClient(conn)}
	return c, nil
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Raw returns the generated client, for anything the wrapper does not cover.
func (c *Client) Raw() gengatev1.GenerationServiceClient { return c.rpc }

// CallOption adjusts one call.
type CallOption func(*metadata.MD)

// WithCallMetadata sends a metadata entry on this call only.
func WithCallMetadata(key, value string) CallOption {
	return func(md *metadata.MD) { md.Append(key, value) }
}

// WithCallToken sends "authorization: Bearer <token>" on this call, replacing the Dial one.
func WithCallToken(token string) CallOption {
	return func(md *metadata.MD) { md.Set("authorization", "Bearer "+token) }
}

func (c *Client) outgoing(ctx context.Context, opts []CallOption) context.Context {
	if len(c.md) == 0 && len(opts) == 0 {
		return ctx
	}
	md := c.md.Copy()
	for _, opt := range opts {
		opt(&md)
	}
	if existing, ok := metadata.FromOutgoingContext(ctx); ok {
		md = metadata.Join(existing, md)
	}
	return metadata.NewOutgoingContext(ctx, md)
}

// Generate runs one request to completion. The context's deadline travels to the server and
// cancelling it aborts the generation there.
func (c *Client) Generate(ctx context.Context, req *Request, opts ...CallOption) (*Response, error) {
	resp, err := c.rpc.Generate(c.outgoing(ctx, opts), req)
	return resp, asError(err)
}

// GenerateStream yields the stream's frames: one start frame, text deltas, then one end frame
// per generation. Breaking out of the loop cancels the call on the server.
func (c *Client) GenerateStream(ctx context.Context, req *Request, opts ...CallOption) iter.Seq2[*Frame, error] {
	return func(yield func(*Frame, error) bool) {
		ctx, cancel := context.WithCancel(c.outgoing(ctx, opts))
		defer cancel()
		stream, err := c.rpc.GenerateStream(ctx, &gengatev1.GenerateStreamRequest{Request: req})
		if err != nil {
			yield(nil, asError(err))
			return
		}
		recvAll(stream, yield)
	}
}

// BatchItem is the outcome of one request of a batch: a response, or the item's own error.
type BatchItem struct {
	Index    int
	Response *Response
	Err      *Error
}

// BatchGenerate runs many requests and yields each item as it completes, in completion order.
// One bad item yields an item with Err set; only a failure of the whole call yields an error.
func (c *Client) BatchGenerate(ctx context.Context, reqs []*Request, opts ...CallOption) iter.Seq2[*BatchItem, error] {
	return func(yield func(*BatchItem, error) bool) {
		ctx, cancel := context.WithCancel(c.outgoing(ctx, opts))
		defer cancel()
		stream, err := c.rpc.BatchGenerate(ctx, &gengatev1.BatchGenerateRequest{Requests: reqs})
		if err != nil {
			yield(nil, asError(err))
			return
		}
		recvAll(stream, func(item *BatchResponse, err error) bool {
			if err != nil {
				return yield(nil, err)
			}
			out := &BatchItem{Index: int(item.GetIndex()), Response: item.GetResponse()}
			if st := item.GetError(); st != nil {
				out.Err = errorFromProto(st)
			}
			return yield(out, nil)
		})
	}
}

// ListModels says which models the server serves and what each can do.
func (c *Client) ListModels(ctx context.Context, opts ...CallOption) ([]*ModelInfo, error) {
	resp, err := c.rpc.ListModels(c.outgoing(ctx, opts), &gengatev1.ListModelsRequest{})
	if err != nil {
		return nil, asError(err)
	}
	return resp.GetModels(), nil
}

func recvAll[T any](stream grpc.ServerStreamingClient[T], yield func(*T, error) bool) {
	for {
		msg, err := stream.Recv()
		if err != nil {
			if !isEOF(err) {
				yield(nil, asError(err))
			}
			return
		}
		if !yield(msg, nil) {
			return
		}
	}
}
