package gengate_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// fakeServer is an in-process GenerationService that answers by simple rules and records
// what it received, so the wrapper is tested without the real server.
type fakeServer struct {
	gengatev1.UnimplementedGenerationServiceServer
	mu       sync.Mutex
	metadata []metadata.MD
	requests []*gengatev1.GenerateRequest
	// cancelled is closed when the server saw an "endless" stream end before its last frame.
	cancelled     chan struct{}
	cancelledOnce sync.Once
	// slowEnded is closed when a "slow" Generate saw its call end (deadline passed or caller
	// gone) server-side; the slow call never answers on its own, so nothing else closes it.
	slowEnded     chan struct{}
	slowEndedOnce sync.Once
	// jsonText is what a json_schema request gets back, with jsonFinish (STOP when unset).
	jsonText   string
	jsonFinish gengatev1.FinishReason
	// toolArguments is the arguments JSON of a call to each tool by name ("{}" when unset).
	toolArguments map[string]string
	// jobs is the BatchJobService served beside it.
	jobs *fakeJobs
	// attempts counts the calls of each method ("Generate", "GetBatchJob", ...), refused ones
	// too; faults are the refusals still to answer, by method (see failNext).
	attempts map[string]int
	faults   map[string]*fault
}

// fault makes the next calls of one method fail with code, before its handler runs.
type fault struct {
	code codes.Code
	// pushback is the grpc-retry-pushback-ms trailer sent with the error ("": none).
	pushback string
	// calls is how many calls fail; later ones are answered by the method's rules again.
	calls int
	// afterFirstMessage fails a server stream after its first message instead of before any.
	afterFirstMessage bool
}

// failNext makes the next ft.calls calls of method fail as ft says.
func (f *fakeServer) failNext(method string, ft fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults[method] = &ft
}

// attemptsOf is how many calls of method the server has received.
func (f *fakeServer) attemptsOf(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.attempts[method]
}

// attempt counts one call of fullMethod and returns the fault it must answer with, if any.
func (f *fakeServer) attempt(fullMethod string) *fault {
	method := fullMethod[strings.LastIndex(fullMethod, "/")+1:]
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attempts[method]++
	ft := f.faults[method]
	if ft == nil || ft.calls == 0 {
		return nil
	}
	ft.calls--
	out := *ft
	return &out
}

// refusal is the status of a fault, with RetryInfo as the real server sends it, and its trailer.
func (ft *fault) refusal() (error, metadata.MD) {
	st, _ := status.New(ft.code, "fake refusal").WithDetails(
		&errdetails.ErrorInfo{Reason: "FAKE_REFUSED", Domain: "gengate.dev"},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(0)},
	)
	md := metadata.MD{}
	if ft.pushback != "" {
		md.Set("grpc-retry-pushback-ms", ft.pushback)
	}
	return st.Err(), md
}

func (f *fakeServer) unaryFaults(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if ft := f.attempt(info.FullMethod); ft != nil {
		err, md := ft.refusal()
		_ = grpc.SetTrailer(ctx, md)
		return nil, err
	}
	return handler(ctx, req)
}

func (f *fakeServer) streamFaults(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ft := f.attempt(info.FullMethod)
	if ft == nil {
		return handler(srv, ss)
	}
	err, md := ft.refusal()
	ss.SetTrailer(md)
	if ft.afterFirstMessage {
		return handler(srv, &failingStream{ServerStream: ss, err: err})
	}
	return err
}

// failingStream lets its first message through, then fails every send with err (the fake's
// handlers return a failed send's error, which ends the call with it).
type failingStream struct {
	grpc.ServerStream
	err  error
	sent int
}

func (s *failingStream) SendMsg(m any) error {
	if s.sent > 0 {
		return s.err
	}
	s.sent++
	return s.ServerStream.SendMsg(m)
}

func (f *fakeServer) record(ctx context.Context, req *gengatev1.GenerateRequest) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.metadata = append(f.metadata, md)
	f.requests = append(f.requests, req)
}

func (f *fakeServer) lastMetadata() metadata.MD {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.metadata[len(f.metadata)-1]
}

func (f *fakeServer) lastRequest() *gengatev1.GenerateRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests[len(f.requests)-1]
}

func check(req *gengatev1.GenerateRequest) error {
	if req.GetModel() != "tiny" {
		st, _ := status.New(codes.NotFound, "unknown model "+req.GetModel()).WithDetails(
			&errdetails.ErrorInfo{Reason: "MODEL_NOT_FOUND", Domain: "gengate.dev"})
		return st.Err()
	}
	if p := req.GetStructuredOutput().GetRegex().GetPattern(); strings.Count(p, "(") != strings.Count(p, ")") {
		st, _ := status.New(codes.InvalidArgument, "invalid regex").WithDetails(&errdetails.BadRequest{
			FieldViolations: []*errdetails.BadRequest_FieldViolation{{
				Field: "structured_output.regex.pattern", Description: "unbalanced parenthesis",
			}},
		})
		return st.Err()
	}
	return nil
}

// toolCalls is how the fake answers a request with tools: a call to each offered tool
// ("call_<i>", toolArguments), only the named one under a named choice, the first only when
// parallel calls are off, none under NONE or after a tool result.
func (f *fakeServer) toolCalls(req *gengatev1.GenerateRequest) []*gengatev1.ToolCall {
	messages := req.GetMessages().GetMessages()
	answered := len(messages) > 0 && messages[len(messages)-1].GetRole() == gengatev1.Role_ROLE_TOOL
	if len(req.GetTools()) == 0 || answered || req.GetToolChoice().GetMode() == gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_NONE {
		return nil
	}
	var calls []*gengatev1.ToolCall
	for _, tool := range req.GetTools() {
		if named := req.GetToolChoice().GetName(); named != "" && named != tool.GetName() {
			continue
		}
		args, ok := f.toolArguments[tool.GetName()]
		if !ok {
			args = "{}"
		}
		calls = append(calls, &gengatev1.ToolCall{Id: fmt.Sprintf("call_%d", len(calls)), Name: tool.GetName(), ArgumentsJson: args})
		if req.ParallelToolCalls != nil && !req.GetParallelToolCalls() {
			break
		}
	}
	return calls
}

// toolResults is the fake's answer after tool results: "<call id> <tool name>=<result>" each,
// "; "-joined, the names found on the assistant turns' calls.
func toolResults(messages []*gengatev1.ChatMessage) string {
	names := map[string]string{}
	var parts []string
	for _, m := range messages {
		for _, c := range m.GetToolCalls() {
			names[c.GetId()] = c.GetName()
		}
		if m.GetRole() == gengatev1.Role_ROLE_TOOL {
			parts = append(parts, fmt.Sprintf("%s %s=%s", m.GetToolCallId(), names[m.GetToolCallId()], m.GetContent()[0].GetText()))
		}
	}
	return strings.Join(parts, "; ")
}

func (f *fakeServer) answer(req *gengatev1.GenerateRequest) *gengatev1.GenerateResponse {
	text, finish := "echo: "+req.GetPrompt(), gengatev1.FinishReason_FINISH_REASON_STOP
	calls := f.toolCalls(req)
	if len(calls) > 0 {
		text, finish = "", gengatev1.FinishReason_FINISH_REASON_TOOL_CALLS
	} else if messages := req.GetMessages().GetMessages(); len(messages) > 0 && messages[len(messages)-1].GetRole() == gengatev1.Role_ROLE_TOOL {
		text = toolResults(messages)
	}
	if req.GetStructuredOutput().GetJsonSchema() != nil {
		text = f.jsonText
		if f.jsonFinish != gengatev1.FinishReason_FINISH_REASON_UNSPECIFIED {
			finish = f.jsonFinish
		}
	}
	resp := &gengatev1.GenerateResponse{RequestId: req.GetRequestId(), Model: req.GetModel()}
	for i := range max(req.GetN(), 1) {
		g := &gengatev1.Generation{Index: i, Text: text, FinishReason: finish, OutputTokens: 3, ToolCalls: calls}
		if m := req.GetMagpie(); m != nil {
			g.Conversation = magpieTurns(m)
			g.Text = g.Conversation[len(g.Conversation)-1].GetText()
		}
		resp.Generations = append(resp.Generations, g)
	}
	return resp
}

// magpieTurns is the conversation a Magpie request gets from the fake: the given turns (0
// tokens), then "question k" (2 tokens) and "answer k" (3 tokens) for each of n_turns (default 1),
// as only_instruction and end_with_user say.
func magpieTurns(m *gengatev1.Magpie) []*gengatev1.ConversationTurn {
	var turns []*gengatev1.ConversationTurn
	for _, given := range m.GetConversation() {
		turns = append(turns, &gengatev1.ConversationTurn{Role: given.GetRole(), Text: given.GetContent()[0].GetText()})
	}
	n := uint32(1)
	if m.NTurns != nil {
		n = m.GetNTurns()
	}
	if m.GetOnlyInstruction() {
		n = 1
	}
	for k := range n {
		turns = append(turns, &gengatev1.ConversationTurn{
			Role: gengatev1.Role_ROLE_USER, Text: fmt.Sprintf("question %d", k+1), OutputTokens: 2,
		})
		if m.GetOnlyInstruction() || (m.GetEndWithUser() && k == n-1) {
			break
		}
		turns = append(turns, &gengatev1.ConversationTurn{
			Role: gengatev1.Role_ROLE_ASSISTANT, Text: fmt.Sprintf("answer %d", k+1), OutputTokens: 3,
		})
	}
	return turns
}

func (f *fakeServer) Generate(ctx context.Context, req *gengatev1.GenerateRequest) (*gengatev1.GenerateResponse, error) {
	f.record(ctx, req)
	if req.GetPrompt() == "slow" {
		// Waits for the call to end: only the deadline or the caller's cancel ends it
		// (srv.Stop at cleanup ends a call the client failed to end).
		<-ctx.Done()
		f.slowEndedOnce.Do(func() { close(f.slowEnded) })
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if err := check(req); err != nil {
		return nil, err
	}
	return f.answer(req), nil
}

func (f *fakeServer) GenerateStream(req *gengatev1.GenerateStreamRequest, stream grpc.ServerStreamingServer[gengatev1.GenerateStreamResponse]) error {
	inner := req.GetRequest()
	f.record(stream.Context(), inner)
	if err := check(inner); err != nil {
		return err
	}
	send := func(frame *gengatev1.GenerateStreamResponse) error { return stream.Send(frame) }
	if err := send(&gengatev1.GenerateStreamResponse{Frame: &gengatev1.GenerateStreamResponse_Start{
		Start: &gengatev1.StreamStart{Model: inner.GetModel(), RequestId: "r1"},
	}}); err != nil {
		return err
	}
	if calls := f.toolCalls(inner); len(calls) > 0 {
		// Each call in two fragments (id and name on the first), then the end frame with the calls.
		for i, call := range calls {
			half := len(call.GetArgumentsJson()) / 2
			for _, fragment := range []*gengatev1.ToolCallDelta{
				{Index: uint32(i), Id: call.GetId(), Name: call.GetName(), ArgumentsFragment: call.GetArgumentsJson()[:half]},
				{Index: uint32(i), ArgumentsFragment: call.GetArgumentsJson()[half:]},
			} {
				if err := send(&gengatev1.GenerateStreamResponse{Frame: &gengatev1.GenerateStreamResponse_Delta{
					Delta: &gengatev1.GenerationDelta{TokenCount: 1, ToolCalls: []*gengatev1.ToolCallDelta{fragment}},
				}}); err != nil {
					return err
				}
			}
		}
		return send(&gengatev1.GenerateStreamResponse{Frame: &gengatev1.GenerateStreamResponse_End{
			End: &gengatev1.GenerationEnd{FinishReason: gengatev1.FinishReason_FINISH_REASON_TOOL_CALLS, ToolCalls: calls},
		}})
	}
	words := strings.Fields(inner.GetPrompt())
	endless := inner.GetPrompt() == "endless" // deltas until the call ends, however long that takes
	for i := 0; endless || i < len(words); i++ {
		w := "x"
		if !endless {
			w = words[i]
		}
		select {
		case <-stream.Context().Done():
			f.cancelledOnce.Do(func() { close(f.cancelled) })
			return stream.Context().Err()
		case <-time.After(time.Millisecond):
		}
		if err := send(&gengatev1.GenerateStreamResponse{Frame: &gengatev1.GenerateStreamResponse_Delta{
			Delta: &gengatev1.GenerationDelta{Text: w + " ", TokenCount: 1},
		}}); err != nil {
			return err
		}
	}
	return send(&gengatev1.GenerateStreamResponse{Frame: &gengatev1.GenerateStreamResponse_End{
		End: &gengatev1.GenerationEnd{FinishReason: gengatev1.FinishReason_FINISH_REASON_STOP,
			Usage: &gengatev1.Usage{OutputTokens: uint32(len(words))}},
	}})
}

func (f *fakeServer) BatchGenerate(req *gengatev1.BatchGenerateRequest, stream grpc.ServerStreamingServer[gengatev1.BatchGenerateResponse]) error {
	for i, item := range req.GetRequests() {
		f.record(stream.Context(), item)
		out := &gengatev1.BatchGenerateResponse{Index: uint32(i)}
		if err := check(item); err != nil {
			out.Result = &gengatev1.BatchGenerateResponse_Error{Error: status.Convert(err).Proto()}
		} else {
			out.Result = &gengatev1.BatchGenerateResponse_Response{Response: f.answer(item)}
		}
		if err := stream.Send(out); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeServer) ListModels(ctx context.Context, _ *gengatev1.ListModelsRequest) (*gengatev1.ListModelsResponse, error) {
	f.record(ctx, nil)
	return &gengatev1.ListModelsResponse{Models: []*gengatev1.ModelInfo{{
		Name: "tiny", Backend: "fake", Capabilities: &gengatev1.ModelCapabilities{MaxN: 4, Seed: true},
	}}}, nil
}

// startFake serves a fakeServer on a loopback port (with TLS when creds is set).
func startFake(t *testing.T, creds credentials.TransportCredentials) (*fakeServer, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fake := &fakeServer{
		cancelled: make(chan struct{}), slowEnded: make(chan struct{}), jsonText: `{"name":"Ada","age":36}`,
		attempts: map[string]int{}, faults: map[string]*fault{},
	}
	opts := []grpc.ServerOption{grpc.UnaryInterceptor(fake.unaryFaults), grpc.StreamInterceptor(fake.streamFaults)}
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	srv := grpc.NewServer(opts...)
	gengatev1.RegisterGenerationServiceServer(srv, fake)
	fake.jobs = newFakeJobs(fake)
	gengatev1.RegisterBatchJobServiceServer(srv, fake.jobs)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return fake, lis.Addr().String()
}

// schemaOf is the schema a request sent: as JSON text (schema_json), never as a Struct.
func schemaOf(t *testing.T, req *gengatev1.GenerateRequest) string {
	t.Helper()
	sent := req.GetStructuredOutput().GetJsonSchema()
	if sent.GetSchema() != nil || sent.GetSchemaJson() == "" {
		t.Fatalf("schema not sent as schema_json: %v", sent)
	}
	return sent.GetSchemaJson()
}
