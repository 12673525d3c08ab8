package gengate_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

// serverSpan is one line of the server's GENGATE_TRACES_FILE.
type serverSpan struct {
	Name       string         `json:"name"`
	Kind       string         `json:"kind"`
	TraceID    string         `json:"trace_id"`
	SpanID     string         `json:"span_id"`
	ParentID   string         `json:"parent_span_id"`
	Attributes map[string]any `json:"attributes"`
}

// readSpans is every span of traceID in the server's traces file so far.
func readSpans(path, traceID string) []serverSpan {
	var spans []serverSpan
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	scanner := bufio.NewScanner(f)
	scanner.Buffer(make([]byte, 1<<20), 1<<24)
	for scanner.Scan() {
		var s serverSpan
		if json.Unmarshal(scanner.Bytes(), &s) == nil && s.TraceID == traceID {
			spans = append(spans, s)
		}
	}
	return spans
}

// serverTraceUnder waits for the SERVER span whose parent is clientSpanID and the spans under it
// (the server span can end just after the client has its reply).
func serverTraceUnder(t *testing.T, path, traceID, clientSpanID string) (serverSpan, []serverSpan) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		spans := readSpans(path, traceID)
		for _, server := range spans {
			if server.Kind != "SERVER" || server.ParentID != clientSpanID {
				continue
			}
			var children []serverSpan
			for _, s := range spans {
				if s.ParentID == server.SpanID {
					children = append(children, s)
				}
			}
			if len(children) > 0 {
				return server, children
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no server span under client span %s with a child, in trace %s of %s: %+v", clientSpanID, traceID, path, spans)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// clientSpan is the otelgrpc client span of one method, from the in-memory exporter.
func clientSpan(t *testing.T, exporter *tracetest.InMemoryExporter, method string) tracetest.SpanStub {
	t.Helper()
	for _, s := range exporter.GetSpans() {
		if s.Name == "gengate.v1.GenerationService/"+method {
			return s
		}
	}
	t.Fatalf("no client span for %s in %v", method, exporter.GetSpans())
	return tracetest.SpanStub{}
}

// TestTraceThroughTheRealServer checks client span → server RPC span → backend span in one
// trace, against a live server started with GENGATE_TRACES_FILE (clients/conformance/run sets
// GENGATE_E2E_ADDRESS and GENGATE_E2E_TRACES_FILE; without them the test is skipped).
func TestTraceThroughTheRealServer(t *testing.T) {
	addr, path := os.Getenv("GENGATE_E2E_ADDRESS"), os.Getenv("GENGATE_E2E_TRACES_FILE")
	if addr == "" || path == "" {
		t.Skip("needs a live server: GENGATE_E2E_ADDRESS and GENGATE_E2E_TRACES_FILE (clients/conformance/run)")
	}
	model := os.Getenv("GENGATE_E2E_MODEL")
	if model == "" {
		model = "tiny"
	}
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	c, err := gengate.Dial(addr, gengate.WithInsecure(), gengate.WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const prompt = "CANARY-go-e2e a short story"
	req := gengate.Prompt(model, prompt)
	req.Stopping = &gengatev1.StoppingCriteria{MaxTokens: gengate.Ptr[uint32](6)}
	ctx, caller := tp.Tracer("test").Start(context.Background(), "caller")
	resp, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	var streamed uint32
	for frame, err := range c.GenerateStream(ctx, req) {
		if err != nil {
			t.Fatal(err)
		}
		streamed += frame.GetEnd().GetUsage().GetOutputTokens()
	}
	caller.End()
	traceID := caller.SpanContext().TraceID().String()

	for _, call := range []struct {
		method       string
		outputTokens uint32
	}{{"Generate", resp.GetUsage().GetOutputTokens()}, {"GenerateStream", streamed}} {
		client := clientSpan(t, exporter, call.method)
		if client.Parent.SpanID() != caller.SpanContext().SpanID() || client.SpanContext.TraceID().String() != traceID {
			t.Fatalf("%s: client span is not under the caller", call.method)
		}
		// Each call has its own server span; find the one whose parent is this call's client span.
		server, children := serverTraceUnder(t, path, traceID, client.SpanContext.SpanID().String())
		if !strings.HasSuffix(server.Name, "GenerationService/"+call.method) {
			t.Fatalf("server span %q under the %s client span", server.Name, call.method)
		}
		backend := children[0]
		if backend.Kind != "CLIENT" || backend.Attributes["gen_ai.request.model"] != model {
			t.Fatalf("backend span %+v", backend)
		}
		if got := backend.Attributes["gen_ai.usage.output_tokens"]; got != float64(call.outputTokens) || call.outputTokens == 0 {
			t.Fatalf("%s: backend span output tokens %v, response says %d", call.method, got, call.outputTokens)
		}
		if _, ok := backend.Attributes["gen_ai.response.finish_reasons"]; !ok {
			t.Fatalf("%s: no finish reasons on the backend span: %v", call.method, backend.Attributes)
		}
		raw, _ := json.Marshal(backend.Attributes)
		if strings.Contains(string(raw), "CANARY") {
			t.Fatalf("the prompt was recorded: %s", raw)
		}
	}
}
