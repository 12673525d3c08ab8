package gengate_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"math/big"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

func dial(t *testing.T, addr string, opts ...gengate.Option) *gengate.Client {
	t.Helper()
	c, err := gengate.Dial(addr, append([]gengate.Option{gengate.WithInsecure()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestGenerateSendsTokenAndReturnsText(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr, gengate.WithBearerToken("s3cret"), gengate.WithMetadata("x-team", "search"))
	req := gengate.Prompt("tiny", "hello")
	req.N = gengate.Ptr[uint32](2)
	resp, err := c.Generate(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetGenerations()) != 2 || resp.GetGenerations()[1].GetText() != "echo: hello" {
		t.Fatalf("unexpected response %v", resp)
	}
	md := fake.lastMetadata()
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer s3cret" {
		t.Fatalf("authorization = %v", got)
	}
	if got := md.Get("x-team"); len(got) != 1 || got[0] != "search" {
		t.Fatalf("x-team = %v", got)
	}

	if _, err := c.Generate(context.Background(), req, gengate.WithCallToken("other"), gengate.WithCallMetadata("x-call", "1")); err != nil {
		t.Fatal(err)
	}
	md = fake.lastMetadata()
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer other" {
		t.Fatalf("per-call token not used: %v", got)
	}
	if got := md.Get("x-call"); len(got) != 1 {
		t.Fatalf("per-call metadata missing: %v", md)
	}
}

func TestErrorsExposeCodeAndDetails(t *testing.T) {
	_, addr := startFake(t, nil)
	c := dial(t, addr)

	_, err := c.Generate(context.Background(), gengate.Prompt("nope", "hi"))
	var gerr *gengate.Error
	if !errors.As(err, &gerr) || gerr.Code != codes.NotFound || gerr.Reason != "MODEL_NOT_FOUND" {
		t.Fatalf("unknown model: %v", err)
	}
	if status.Code(err) != codes.NotFound {
		t.Fatalf("status.Code = %v", status.Code(err))
	}

	req := gengate.Prompt("tiny", "hi")
	req.StructuredOutput = gengate.Regex("(ab")
	_, err = c.Generate(context.Background(), req)
	if !errors.As(err, &gerr) || gerr.Code != codes.InvalidArgument {
		t.Fatalf("bad regex: %v", err)
	}
	if v, ok := gerr.Field("structured_output.regex.pattern"); !ok || v.Description == "" {
		t.Fatalf("no field violation in %v", gerr)
	}
	if !strings.Contains(err.Error(), "structured_output.regex.pattern") {
		t.Fatalf("message lacks the field: %s", err)
	}
}

func TestDeadlineEndsTheCall(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	// The slow call never answers: only the deadline can end it.
	_, err := c.Generate(ctx, gengate.Prompt("tiny", "slow"))
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
	select { // the bound only guards against a hang
	case <-fake.slowEnded:
	case <-time.After(10 * time.Second):
		t.Fatal("the server never saw the call end: the deadline reached neither the server nor the connection")
	}
}

func TestStreamYieldsFramesInOrder(t *testing.T) {
	_, addr := startFake(t, nil)
	c := dial(t, addr)
	var text strings.Builder
	var kinds []string
	for frame, err := range c.GenerateStream(context.Background(), gengate.Prompt("tiny", "a b c")) {
		if err != nil {
			t.Fatal(err)
		}
		switch f := frame.GetFrame().(type) {
		case *gengatev1.GenerateStreamResponse_Start:
			kinds = append(kinds, "start")
		case *gengatev1.GenerateStreamResponse_Delta:
			kinds = append(kinds, "delta")
			text.WriteString(f.Delta.GetText())
		case *gengatev1.GenerateStreamResponse_End:
			kinds = append(kinds, "end")
		}
	}
	if strings.Join(kinds, ",") != "start,delta,delta,delta,end" || text.String() != "a b c " {
		t.Fatalf("frames %v text %q", kinds, text.String())
	}
}

func TestBreakingOutOfAStreamCancelsIt(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	deltas := 0
	for frame, err := range c.GenerateStream(context.Background(), gengate.Prompt("tiny", "endless")) {
		if err != nil {
			t.Fatal(err)
		}
		if frame.GetDelta() != nil {
			deltas++
			if deltas == 3 {
				break
			}
		}
	}
	select {
	case <-fake.cancelled:
	case <-time.After(10 * time.Second): // a hang guard: the endless stream ends only when cancelled
		t.Fatal("the server never saw the cancellation")
	}
}

func TestStreamErrorIsYielded(t *testing.T) {
	_, addr := startFake(t, nil)
	c := dial(t, addr)
	for _, err := range c.GenerateStream(context.Background(), gengate.Prompt("nope", "x")) {
		if status.Code(err) != codes.NotFound {
			t.Fatalf("err = %v", err)
		}
		return
	}
	t.Fatal("no error yielded")
}

func TestBatchReportsTheBadItemAlone(t *testing.T) {
	_, addr := startFake(t, nil)
	c := dial(t, addr)
	reqs := []*gengate.Request{gengate.Prompt("tiny", "one"), gengate.Prompt("nope", "two"), gengate.Prompt("tiny", "three")}
	got := map[int]*gengate.BatchItem{}
	for item, err := range c.BatchGenerate(context.Background(), reqs) {
		if err != nil {
			t.Fatal(err)
		}
		got[item.Index] = item
	}
	if len(got) != 3 || got[0].Response.GetGenerations()[0].GetText() != "echo: one" || got[2].Err != nil {
		t.Fatalf("batch = %v", got)
	}
	if got[1].Err == nil || got[1].Err.Code != codes.NotFound || got[1].Err.Reason != "MODEL_NOT_FOUND" {
		t.Fatalf("bad item = %+v", got[1])
	}
}

func TestListModels(t *testing.T) {
	_, addr := startFake(t, nil)
	models, err := dial(t, addr).ListModels(context.Background())
	if err != nil || len(models) != 1 || models[0].GetName() != "tiny" || models[0].GetCapabilities().GetMaxN() != 4 {
		t.Fatalf("models = %v, %v", models, err)
	}
}

type person struct {
	Name string `json:"name" jsonschema:"minLength=1"`
	Age  int    `json:"age" jsonschema:"minimum=0,maximum=150"`
	Note string `json:"note,omitempty"`
}

func TestGenerateJSONDecodesIntoTheType(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	req := gengate.Prompt("tiny", "a person")
	p, resp, err := gengate.GenerateJSON[person](context.Background(), c, req)
	if err != nil {
		t.Fatal(err)
	}
	if p != (person{Name: "Ada", Age: 36}) || resp.GetModel() != "tiny" {
		t.Fatalf("decoded %+v", p)
	}
	if req.GetStructuredOutput() != nil {
		t.Fatal("GenerateJSON modified the caller's request")
	}
	sent := fake.lastRequest().GetStructuredOutput().GetJsonSchema()
	var schema map[string]any
	if err := json.Unmarshal([]byte(schemaOf(t, fake.lastRequest())), &schema); err != nil {
		t.Fatal(err)
	}
	required, _ := schema["required"].([]any)
	if sent.GetName() != "person" || schema["type"] != "object" || len(required) != 2 || schema["additionalProperties"] != false {
		t.Fatalf("schema sent: %v (name %q)", schema, sent.GetName())
	}
	age := schema["properties"].(map[string]any)["age"].(map[string]any)
	if age["maximum"] != float64(150) {
		t.Fatalf("age schema %v", age)
	}
	if order := propertyOrder(t, schemaOf(t, fake.lastRequest())); !slices.Equal(order, []string{"name", "age", "note"}) {
		t.Fatalf("properties sent in order %v, want the struct's field order", order)
	}
}

// propertyOrder reads the keys of a schema's top-level "properties" in the order the text has them.
func propertyOrder(t *testing.T, schemaJSON string) []string {
	t.Helper()
	var top map[string]json.RawMessage
	if err := json.Unmarshal([]byte(schemaJSON), &top); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(top["properties"]))
	if _, err := dec.Token(); err != nil { // {
		t.Fatal(err)
	}
	var keys []string
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, key.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

func TestJSONSchemaSendsTheTextAsIs(t *testing.T) {
	fake, addr := startFake(t, nil)
	text := `{"type":"object","properties":{"zeta":{"type":"integer","maximum":9007199254740993},"alpha":{"type":"string"}}}`
	structured, err := gengate.JSONSchema("big", []byte(text))
	if err != nil {
		t.Fatal(err)
	}
	req := gengate.Prompt("tiny", "x")
	req.StructuredOutput = structured
	if _, err := dial(t, addr).Generate(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if got := schemaOf(t, fake.lastRequest()); got != text {
		t.Fatalf("sent %s", got)
	}
	if _, err := gengate.JSONSchema("bad", []byte(`[1]`)); err == nil {
		t.Fatal("a JSON array was accepted as a schema")
	}
}

func TestDecodeJSONKeepsExactIntegersInTheSchema(t *testing.T) {
	schema := []byte(`{"type":"object","properties":{"n":{"type":"integer","maximum":9007199254740993}}}`)
	if _, err := gengate.DecodeJSON[map[string]int64](schema, `{"n":9007199254740993}`); err != nil {
		t.Fatalf("the maximum itself was refused: %v", err)
	}
	if _, err := gengate.DecodeJSON[map[string]int64](schema, `{"n":9007199254740994}`); !errors.Is(err, gengate.ErrInvalidOutput) {
		t.Fatalf("one over the maximum: %v", err)
	}
}

func TestGenerateJSONRefusesOutputOutsideTheSchema(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	for _, bad := range []string{`{"name":"Ada","age":501}`, `{"name":"Ada"}`, `not json`} {
		fake.jsonText = bad
		_, _, err := gengate.GenerateJSON[person](context.Background(), c, gengate.Prompt("tiny", "x"))
		if !errors.Is(err, gengate.ErrInvalidOutput) {
			t.Fatalf("%s: err = %v", bad, err)
		}
	}
}

func TestGenerateJSONReportsATruncatedGenerationBeforeParsing(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.jsonText, fake.jsonFinish = `{"name":"Ad`, gengatev1.FinishReason_FINISH_REASON_LENGTH
	_, _, err := gengate.GenerateJSON[person](context.Background(), c, gengate.Prompt("tiny", "x"))
	if !errors.Is(err, gengate.ErrTruncatedOutput) || errors.Is(err, gengate.ErrInvalidOutput) {
		t.Fatalf("err = %v", err)
	}
	// a complete object cut by LENGTH is still truncated: the finish reason decides, not the parse
	fake.jsonText = `{"name":"Ada","age":36}`
	if _, _, err := gengate.GenerateJSON[person](context.Background(), c, gengate.Prompt("tiny", "x")); !errors.Is(err, gengate.ErrTruncatedOutput) {
		t.Fatalf("err = %v", err)
	}
}

func TestTLSAndTokenOverTLS(t *testing.T) {
	cert, pool := selfSigned(t)
	fake, addr := startFake(t, credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}}))
	c, err := gengate.Dial(addr, gengate.WithTLS(&tls.Config{RootCAs: pool, ServerName: "localhost"}), gengate.WithBearerToken("t"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Generate(context.Background(), gengate.Prompt("tiny", "over tls")); err != nil {
		t.Fatal(err)
	}
	if got := fake.lastMetadata().Get("authorization"); len(got) != 1 || got[0] != "Bearer t" {
		t.Fatalf("authorization = %v", got)
	}
	// Without the CA the handshake must fail: TLS is really in use. (A failed handshake is
	// UNAVAILABLE, which the client would retry: off here, the refusal is what is tested.)
	plain, _ := gengate.Dial(addr, gengate.WithTLS(&tls.Config{ServerName: "localhost"}), gengate.WithMaxRetries(0))
	defer plain.Close()
	if _, err := plain.Generate(context.Background(), gengate.Prompt("tiny", "x")); status.Code(err) != codes.Unavailable {
		t.Fatalf("untrusted server accepted: %v", err)
	}
}

func TestTraceparentCarriesTheClientSpan(t *testing.T) {
	fake, addr := startFake(t, nil)
	exporter := tracetest.NewInMemoryExporter()
	tp := trace.NewTracerProvider(trace.WithSyncer(exporter))
	c := dial(t, addr, gengate.WithTracerProvider(tp))
	ctx, parent := tp.Tracer("test").Start(context.Background(), "caller")
	if _, err := c.Generate(ctx, gengate.Prompt("tiny", "traced")); err != nil {
		t.Fatal(err)
	}
	parent.End()
	header := fake.lastMetadata().Get("traceparent")
	if len(header) != 1 {
		t.Fatalf("no traceparent in %v", fake.lastMetadata())
	}
	parts := strings.Split(header[0], "-")
	if len(parts) != 4 || parts[0] != "00" || len(parts[1]) != 32 || len(parts[2]) != 16 {
		t.Fatalf("malformed traceparent %q", header[0])
	}
	var rpcSpan tracetest.SpanStub
	for _, s := range exporter.GetSpans() {
		if s.Name == "gengate.v1.GenerationService/Generate" {
			rpcSpan = s
		}
	}
	if rpcSpan.Name == "" {
		t.Fatalf("no client RPC span in %v", exporter.GetSpans())
	}
	if parts[1] != rpcSpan.SpanContext.TraceID().String() || parts[1] != parent.SpanContext().TraceID().String() {
		t.Fatalf("trace id %s != client span %s", parts[1], rpcSpan.SpanContext.TraceID())
	}
	if parts[2] != rpcSpan.SpanContext.SpanID().String() || rpcSpan.Parent.SpanID() != parent.SpanContext().SpanID() {
		t.Fatal("traceparent does not name the client RPC span as parent")
	}
}

func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}
