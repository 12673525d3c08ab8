// Command conformance runs clients/conformance/vectors.json with the Go client and prints
// {"language": "go", "results": [...]} as JSON (see clients/conformance/run).
//
//	go run ./internal/conformance ADDRESS VECTORS
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	validator "github.com/santhosh-tekuri/jsonschema/v6"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

type vector struct {
	Name              string            `json:"name"`
	Call              string            `json:"call"`
	Request           json.RawMessage   `json:"request"`
	Requests          []json.RawMessage `json:"requests"`
	Expect            map[string]any    `json:"expect"`
	Repeat            int               `json:"repeat"`
	TimeoutMs         int               `json:"timeout_ms"`
	CancelAfterDeltas int               `json:"cancel_after_deltas"`
	// Client holds options of a client made for this vector alone ({"max_retries": N}).
	Client map[string]any `json:"client"`
	// ToolResults answers the first response's calls by id (call tool_round_trip).
	ToolResults map[string]string `json:"tool_results"`
}

type errorOut struct {
	Code   string   `json:"code"`
	Reason string   `json:"reason"`
	Fields []string `json:"fields"`
	// RetryDelay is the error's google.rpc.RetryInfo delay (checked, not observed).
	RetryDelay time.Duration `json:"-"`
}

// outcome is what one call produced, in the same shape every runner uses.
type outcome struct {
	Err           *errorOut
	Texts         []string
	FinishReasons []string
	OutputTokens  []uint32
	Enforcement   string
	Seed          string
	FramesOrdered bool
	Cancelled     bool
	// Conversations holds each generation's Magpie turns (gengate.Conversation), when any has some.
	Conversations [][]turnOut
	// ToolCalls holds each generation's tool calls (a stream's: its end frames').
	ToolCalls [][]*gengate.ToolCall
	// FragmentsMatchEnd: a stream's fragments, assembled by gengate.StreamToolCalls, were its end
	// frames' calls (names and arguments), and there was at least one.
	FragmentsMatchEnd bool
}

// turnOut is one Magpie turn as every runner observes it (roles by their proto names).
type turnOut struct {
	Role         string `json:"role"`
	Text         string `json:"text"`
	OutputTokens uint32 `json:"output_tokens"`
}

// The expect keys this runner checks: check()'s, then those runVector reads itself (a vector's
// expect), or "ok" (a batch item's). A key outside them fails its vector, so a vector can never
// pass by being ignored.
var (
	checkedKeys = []string{"code", "reason", "field_violation", "generations", "max_output_tokens",
		"finish_reasons", "seed_echoed", "enforcement", "valid_json_schema", "full_match", "one_of",
		"json_object", "key_order", "frames_ordered", "cancelled", "retry_after_s", "conversation_roles",
		"tool_calls", "tool_fragments_match_end"}
	vectorKeys = keySet(checkedKeys, "model_listed", "constraint_kinds", "backend_options",
		"same_text_on_repeat", "stream_equals_unary", "items", "server_aborted", "server_attempts")
	itemKeys = keySet(checkedKeys, "ok")
)

func keySet(base []string, more ...string) map[string]bool {
	set := map[string]bool{}
	for _, k := range append(slices.Clone(base), more...) {
		set[k] = true
	}
	return set
}

// unknownKeys fails each key of expect that known lacks.
func unknownKeys(expect map[string]any, known map[string]bool, where string) []string {
	var failures []string
	for key := range expect {
		if !known[key] {
			failures = append(failures, fmt.Sprintf("%sunknown expect key %q", where, key))
		}
	}
	sort.Strings(failures)
	return failures
}

type result struct {
	Name     string         `json:"name"`
	OK       bool           `json:"ok"`
	Failures []string       `json:"failures"`
	Observed map[string]any `json:"observed"`
}

// parseRequest reads a vector's protobuf-JSON request. A Magpie input is rebuilt with the
// client's typed helper (gengate.Magpie, gengate.MagpieRequest), so the vector tests that path;
// one the helper cannot express exactly is an error rather than a different request.
func parseRequest(raw json.RawMessage) (*gengate.Request, error) {
	req := &gengate.Request{}
	if err := protojson.Unmarshal(raw, req); err != nil {
		return req, err
	}
	if m := req.GetMagpie(); m != nil {
		template := m.GetTemplate()
		if _, isPreset := m.GetPreQuery().(*gengatev1.Magpie_Preset); isPreset {
			template = strings.ToLower(strings.TrimPrefix(m.GetPreset().String(), "MAGPIE_PRESET_"))
		}
		typed := gengate.MagpieRequest(req.GetModel(), gengate.Magpie{
			Template: template, SystemPrompt: m.GetSystemPrompt(), Conversation: m.GetConversation(),
			NTurns: m.GetNTurns(), OnlyInstruction: m.GetOnlyInstruction(), EndWithUser: m.GetEndWithUser(),
		})
		if !proto.Equal(typed.GetMagpie(), m) {
			return req, fmt.Errorf("gengate.Magpie cannot express the vector's magpie %v (it builds %v)", m, typed.GetMagpie())
		}
		req.Input = typed.Input
	}
	if err := typedTools(req); err != nil {
		return req, err
	}
	return req, nil
}

func fromErr(err error) *outcome {
	var gerr *gengate.Error
	if !errors.As(err, &gerr) {
		return &outcome{Err: &errorOut{Code: "CLIENT_ERROR", Reason: err.Error(), Fields: []string{}}}
	}
	return &outcome{Err: toErrorOut(gerr)}
}

func toErrorOut(gerr *gengate.Error) *errorOut {
	fields := []string{}
	for _, v := range gerr.FieldViolations {
		fields = append(fields, v.Field)
	}
	sort.Strings(fields)
	return &errorOut{Code: codeName(gerr.Code.String()), Reason: gerr.Reason, Fields: fields, RetryDelay: gerr.RetryDelay}
}

// codeName turns Go's "NotFound" into the spec's "NOT_FOUND".
func codeName(s string) string {
	if s == "Canceled" {
		return "CANCELLED"
	}
	var b strings.Builder
	for i, r := range s {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}

func fromResponse(resp *gengate.Response) *outcome {
	out := &outcome{Enforcement: resp.GetEnforcement().String()}
	for _, g := range resp.GetGenerations() {
		out.Texts = append(out.Texts, g.GetText())
		out.FinishReasons = append(out.FinishReasons, g.GetFinishReason().String())
		out.OutputTokens = append(out.OutputTokens, g.GetOutputTokens())
		turns := []turnOut{}
		for _, t := range gengate.Conversation(g) {
			turns = append(turns, turnOut{Role: t.Role.String(), Text: t.Text, OutputTokens: t.OutputTokens})
		}
		out.Conversations = append(out.Conversations, turns)
		out.ToolCalls = append(out.ToolCalls, g.GetToolCalls())
	}
	if !slices.ContainsFunc(out.Conversations, func(turns []turnOut) bool { return len(turns) > 0 }) {
		out.Conversations = nil
	}
	if s := resp.GetEffectiveSampling(); s != nil && s.Seed != nil {
		out.Seed = fmt.Sprint(s.GetSeed())
	}
	return out
}

// generateObject runs a structured request and decodes its first generation with the typed
// path (DecodeGeneration): a truncated generation is CLIENT_TRUNCATED_OUTPUT, a bad one
// CLIENT_OUTPUT_ERROR, as the other runners name their clients' errors.
func generateObject(ctx context.Context, c *gengate.Client, raw json.RawMessage) *outcome {
	req, err := parseRequest(raw)
	if err != nil {
		return fromErr(err)
	}
	resp, err := c.Generate(ctx, req)
	if err != nil {
		return fromErr(err)
	}
	if len(resp.GetGenerations()) > 0 {
		schema := []byte(req.GetStructuredOutput().GetJsonSchema().GetSchemaJson())
		if _, err := gengate.DecodeGeneration[any](schema, resp.GetGenerations()[0]); err != nil {
			code := "CLIENT_OUTPUT_ERROR"
			if errors.Is(err, gengate.ErrTruncatedOutput) {
				code = "CLIENT_TRUNCATED_OUTPUT"
			}
			return &outcome{Err: &errorOut{Code: code, Fields: []string{}}}
		}
	}
	return fromResponse(resp)
}

func generate(ctx context.Context, c *gengate.Client, raw json.RawMessage, timeoutMs int) *outcome {
	req, err := parseRequest(raw)
	if err != nil {
		return fromErr(err)
	}
	if timeoutMs > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutMs)*time.Millisecond)
		defer cancel()
	}
	resp, err := c.Generate(ctx, req)
	if err != nil {
		return fromErr(err)
	}
	return fromResponse(resp)
}

func stream(ctx context.Context, c *gengate.Client, raw json.RawMessage) *outcome {
	req, err := parseRequest(raw)
	if err != nil {
		return fromErr(err)
	}
	texts := map[uint32]string{}
	ends := map[uint32]*gengatev1.GenerationEnd{}
	var calls gengate.StreamToolCalls
	fragments := 0
	type frameKind struct {
		kind  string
		index int
	}
	var kinds []frameKind
	for frame, err := range c.GenerateStream(ctx, req) {
		if err != nil {
			return fromErr(err)
		}
		calls.Add(frame)
		fragments += len(frame.GetDelta().GetToolCalls())
		switch f := frame.GetFrame().(type) {
		case *gengatev1.GenerateStreamResponse_Start:
			kinds = append(kinds, frameKind{"start", -1})
		case *gengatev1.GenerateStreamResponse_Delta:
			kinds = append(kinds, frameKind{"delta", int(f.Delta.GetIndex())})
			texts[f.Delta.GetIndex()] += f.Delta.GetText()
		case *gengatev1.GenerateStreamResponse_End:
			kinds = append(kinds, frameKind{"end", int(f.End.GetIndex())})
			ends[f.End.GetIndex()] = f.End
		}
	}
	indexSet := map[uint32]bool{}
	for i := range texts {
		indexSet[i] = true
	}
	for i := range ends {
		indexSet[i] = true
	}
	var indices []uint32
	for i := range indexSet {
		indices = append(indices, i)
	}
	slices.Sort(indices)
	out := &outcome{FragmentsMatchEnd: fragments > 0}
	for _, i := range indices {
		out.Texts = append(out.Texts, texts[i])
		if e, ok := ends[i]; ok {
			out.FinishReasons = append(out.FinishReasons, e.GetFinishReason().String())
			out.OutputTokens = append(out.OutputTokens, e.GetUsage().GetOutputTokens())
		}
		final, _ := calls.Final(i)
		out.ToolCalls = append(out.ToolCalls, final)
		partial := calls.Partial(i)
		if len(partial) != len(final) {
			out.FragmentsMatchEnd = false
		}
		// Names and arguments: the end frame's ids are the final ones (the server makes those a
		// backend left out, after the fragments went).
		for k := range min(len(partial), len(final)) {
			if partial[k].GetName() != final[k].GetName() || partial[k].GetArgumentsJson() != final[k].GetArgumentsJson() {
				out.FragmentsMatchEnd = false
			}
		}
	}
	// One start first; per index, deltas before exactly one end, nothing after it.
	ordered := len(kinds) > 0 && kinds[0].kind == "start"
	ended := map[int]bool{}
	for _, k := range kinds[min(1, len(kinds)):] {
		if k.kind == "start" || ended[k.index] {
			ordered = false
		}
		if k.kind == "end" {
			ended[k.index] = true
		}
	}
	out.FramesOrdered = ordered && len(ended) > 0
	return out
}

func cancelStream(ctx context.Context, c *gengate.Client, raw json.RawMessage, after int) *outcome {
	req, err := parseRequest(raw)
	if err != nil {
		return fromErr(err)
	}
	deltas, finished := 0, true
	for frame, err := range c.GenerateStream(ctx, req) {
		if err != nil {
			return fromErr(err)
		}
		if frame.GetDelta() != nil {
			deltas++
			if deltas == after {
				finished = false
				break // leaving the loop cancels the call
			}
		}
	}
	return &outcome{Cancelled: deltas == after && !finished}
}

// probeCount asks a probe model (scripted, answer_cancellations_of or answer_calls_of) for its
// count: how many generations the server has abandoned, or calls received, on the model it
// watches.
func probeCount(ctx context.Context, c *gengate.Client, probe string) (int, error) {
	resp, err := c.Generate(ctx, gengate.Prompt(probe, "count"))
	if err != nil {
		return 0, fmt.Errorf("probe %s: %w", probe, err)
	}
	gens := resp.GetGenerations()
	if len(gens) == 0 {
		return 0, fmt.Errorf("probe %s answered no generation", probe)
	}
	n, err := strconv.Atoi(strings.TrimSpace(gens[0].GetText()))
	if err != nil {
		return 0, fmt.Errorf("probe %s answered %q, not a count", probe, gens[0].GetText())
	}
	return n, nil
}

// awaitAbort polls the probe every 50 ms until the abandoned count passes before, for at most 10 s.
func awaitAbort(ctx context.Context, c *gengate.Client, probe string, before int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := probeCount(ctx, c, probe)
		if err != nil {
			return err
		}
		if n > before {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server did not abort the generation (abandoned count stayed %d)", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func check(expect map[string]any, out *outcome, raw json.RawMessage) []string {
	var failures []string
	fail := func(format string, args ...any) { failures = append(failures, fmt.Sprintf(format, args...)) }
	if code, ok := expect["code"].(string); ok {
		if out.Err == nil || out.Err.Code != code {
			return []string{fmt.Sprintf("expected %s, got %+v", code, out.Err)}
		}
		if reason, ok := expect["reason"].(string); ok && out.Err.Reason != reason {
			fail("reason %q != %q", out.Err.Reason, reason)
		}
		if field, ok := expect["field_violation"].(string); ok && !slices.Contains(out.Err.Fields, field) {
			fail("no field violation %s in %v", field, out.Err.Fields)
		}
		if want, ok := expect["retry_after_s"].(float64); ok && out.Err.RetryDelay.Seconds() != want {
			fail("retry delay %v s != %v s", out.Err.RetryDelay.Seconds(), want)
		}
		return failures
	}
	if _, ok := expect["retry_after_s"]; ok {
		return []string{"retry_after_s is checked on an error only: the vector needs a code"}
	}
	if out.Err != nil {
		return []string{fmt.Sprintf("unexpected error %+v", *out.Err)}
	}
	if n, ok := expect["generations"].(float64); ok && len(out.Texts) != int(n) {
		fail("%d generations, expected %v", len(out.Texts), n)
	}
	if n, ok := expect["max_output_tokens"].(float64); ok {
		for _, t := range out.OutputTokens {
			if float64(t) > n {
				fail("output_tokens %v over %v", out.OutputTokens, n)
			}
		}
	}
	if allowed, ok := expect["finish_reasons"].([]any); ok {
		for _, r := range out.FinishReasons {
			if !slices.Contains(allowed, any(r)) {
				fail("finish reason %s not in %v", r, allowed)
			}
		}
	}
	if seed, ok := expect["seed_echoed"].(string); ok && out.Seed != seed {
		fail("seed %q != %q", out.Seed, seed)
	}
	if allowed, ok := expect["enforcement"].([]any); ok && !slices.Contains(allowed, any(out.Enforcement)) {
		fail("enforcement %s not in %v", out.Enforcement, allowed)
	}
	if expect["valid_json_schema"] == true {
		var req struct {
			StructuredOutput struct {
				JSONSchema struct {
					Schema     any    `json:"schema"`
					SchemaJSON string `json:"schemaJson"`
				} `json:"jsonSchema"`
			} `json:"structuredOutput"`
		}
		_ = json.Unmarshal(raw, &req)
		sent := req.StructuredOutput.JSONSchema.Schema
		if text := req.StructuredOutput.JSONSchema.SchemaJSON; text != "" {
			sent, _ = validator.UnmarshalJSON(strings.NewReader(text))
		}
		compiler := validator.NewCompiler()
		if err := compiler.AddResource("vector://schema.json", sent); err != nil {
			fail("schema: %v", err)
		} else if schema, err := compiler.Compile("vector://schema.json"); err != nil {
			fail("schema: %v", err)
		} else {
			for _, text := range out.Texts {
				doc, err := validator.UnmarshalJSON(strings.NewReader(text))
				if err == nil {
					err = schema.Validate(doc)
				}
				if err != nil {
					fail("%q does not match the schema: %v", text, err)
				}
			}
		}
	}
	if pattern, ok := expect["full_match"].(string); ok {
		re := regexp.MustCompile("^(?:" + pattern + ")$")
		for _, t := range out.Texts {
			if !re.MatchString(t) {
				fail("%q does not match %s", t, pattern)
			}
		}
	}
	if choices, ok := expect["one_of"].([]any); ok {
		for _, t := range out.Texts {
			if !slices.Contains(choices, any(t)) {
				fail("%q not one of %v", t, choices)
			}
		}
	}
	if expect["json_object"] == true {
		for _, t := range out.Texts {
			var obj map[string]any
			if err := json.Unmarshal([]byte(t), &obj); err != nil || obj == nil {
				fail("%q is not a JSON object", t)
			}
		}
	}
	if order, ok := expect["key_order"].([]any); ok {
		for _, t := range out.Texts {
			if keys := topLevelKeys(t); !slices.Equal(keys, order) {
				fail("%q: keys %v, expected in order %v", t, keys, order)
			}
		}
	}
	if expect["frames_ordered"] == true && !out.FramesOrdered {
		fail("frames out of order")
	}
	if expect["cancelled"] == true && !out.Cancelled {
		fail("the stream was not cancelled")
	}
	if want, ok := expect["tool_calls"].([]any); ok {
		if len(out.ToolCalls) != len(out.Texts) {
			fail("tool calls of %d generations, expected %d", len(out.ToolCalls), len(out.Texts))
		}
		for i, calls := range out.ToolCalls {
			failures = append(failures, checkToolCalls(i, calls, want)...)
		}
	}
	if expect["tool_fragments_match_end"] == true && !out.FragmentsMatchEnd {
		fail("the tool-call fragments do not assemble into the end frames' calls")
	}
	if want, ok := expect["conversation_roles"].([]any); ok {
		if len(out.Conversations) != len(out.Texts) {
			fail("no conversation in %d generations", len(out.Texts))
		}
		for i, turns := range out.Conversations {
			roles := []any{}
			for _, t := range turns {
				roles = append(roles, t.Role)
			}
			if !slices.Equal(roles, want) {
				fail("generation %d: roles %v, expected %v", i, roles, want)
			}
		}
	}
	return failures
}

// topLevelKeys lists a JSON object's keys in the order the text has them (nil if not an object).
func topLevelKeys(text string) []any {
	dec := json.NewDecoder(strings.NewReader(text))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	var keys []any
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return nil
		}
		keys = append(keys, key)
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return nil
		}
	}
	return keys
}

func observe(out *outcome) map[string]any {
	if out.Err != nil {
		return map[string]any{"error": out.Err}
	}
	observed := map[string]any{"texts": textsOrEmpty(out.Texts)}
	if out.Conversations != nil {
		observed["conversations"] = out.Conversations
	}
	if calls := observeToolCalls(out.ToolCalls); calls != nil {
		observed["tool_calls"] = calls
	}
	return observed
}

func runVector(ctx context.Context, c *gengate.Client, v vector) result {
	failures := unknownKeys(v.Expect, vectorKeys, "")
	if items, ok := v.Expect["items"].([]any); ok {
		for i, item := range items {
			sub, _ := item.(map[string]any)
			failures = append(failures, unknownKeys(sub, itemKeys, fmt.Sprintf("item %d: ", i))...)
		}
	}
	observed := map[string]any{}
	// server_aborted names a probe model: the server must abandon the call's generation.
	probe, probed := v.Expect["server_aborted"]
	probeName, _ := probe.(string)
	abandonedBefore := 0
	if probed {
		if probeName == "" {
			return result{Name: v.Name, Failures: []string{fmt.Sprintf("server_aborted must name a probe model, not %v", probe)}, Observed: observed}
		}
		n, err := probeCount(ctx, c, probeName)
		if err != nil {
			return result{Name: v.Name, Failures: []string{err.Error()}, Observed: observed}
		}
		abandonedBefore = n
	}
	// server_attempts is {probe, count}: the probe's call count must grow by count (the
	// client's attempts, retries included).
	attemptsProbe, attemptsWant, attemptsBefore := "", 0, 0
	if spec, ok := v.Expect["server_attempts"]; ok {
		m, _ := spec.(map[string]any)
		name, _ := m["probe"].(string)
		count, isNumber := m["count"].(float64)
		if name == "" || !isNumber || len(m) != 2 {
			return result{Name: v.Name, Failures: []string{fmt.Sprintf("server_attempts must be {probe, count}, not %v", spec)}, Observed: observed}
		}
		n, err := probeCount(ctx, c, name)
		if err != nil {
			return result{Name: v.Name, Failures: []string{err.Error()}, Observed: observed}
		}
		attemptsProbe, attemptsWant, attemptsBefore = name, int(count), n
	}
	switch v.Call {
	case "list_models":
		models, err := c.ListModels(ctx)
		if err != nil {
			failures = append(failures, err.Error())
			break
		}
		var names []string
		want, _ := v.Expect["model_listed"].(string)
		var found *gengate.ModelInfo
		for _, m := range models {
			names = append(names, m.GetName())
			if m.GetName() == want {
				found = m
			}
		}
		sort.Strings(names)
		observed["models"] = names
		if found == nil {
			failures = append(failures, fmt.Sprintf("%s not in %v", want, names))
			break
		}
		kinds := map[string]bool{}
		for _, cs := range found.GetCapabilities().GetConstraints() {
			kinds[cs.GetKind().String()] = true
		}
		wanted, _ := v.Expect["constraint_kinds"].([]any)
		for _, k := range wanted {
			if !kinds[k.(string)] {
				failures = append(failures, fmt.Sprintf("%s not supported", k))
			}
		}
		options := append([]string{}, found.GetCapabilities().GetBackendOptions()...)
		observed["backend_options"] = options
		if want, ok := v.Expect["backend_options"].([]any); ok {
			wantOptions := make([]string, len(want))
			for i, o := range want {
				wantOptions[i] = o.(string)
			}
			if !slices.Equal(options, wantOptions) {
				failures = append(failures, fmt.Sprintf("backend options %v, want %v", options, wantOptions))
			}
		}
	case "generate":
		out := generate(ctx, c, v.Request, v.TimeoutMs)
		failures = append(failures, check(v.Expect, out, v.Request)...)
		if v.Expect["same_text_on_repeat"] == true {
			for range max(v.Repeat, 2) - 1 {
				again := generate(ctx, c, v.Request, 0)
				if !slices.Equal(again.Texts, out.Texts) {
					failures = append(failures, fmt.Sprintf("repeat gave %q, first %q", again.Texts, out.Texts))
				}
			}
		}
		observed = observe(out)
		if v.TimeoutMs > 0 && out.Err != nil { // client or server may end it first: code only
			observed = map[string]any{"code": out.Err.Code}
		}
	case "generate_object":
		out := generateObject(ctx, c, v.Request)
		failures = append(failures, check(v.Expect, out, v.Request)...)
		observed = observe(out)
	case "stream":
		out := stream(ctx, c, v.Request)
		failures = append(failures, check(v.Expect, out, v.Request)...)
		if v.Expect["stream_equals_unary"] == true && out.Err == nil {
			unary := generate(ctx, c, v.Request, 0)
			if !slices.Equal(unary.Texts, out.Texts) {
				failures = append(failures, fmt.Sprintf("stream texts %q != unary %q", out.Texts, unary.Texts))
			}
			streamed, _ := json.Marshal(observeToolCalls(out.ToolCalls))
			unaryCalls, _ := json.Marshal(observeToolCalls(unary.ToolCalls))
			if string(streamed) != string(unaryCalls) {
				failures = append(failures, fmt.Sprintf("stream tool calls %s != unary %s", streamed, unaryCalls))
			}
		}
		observed = observe(out)
	case "tool_round_trip":
		out := toolRoundTrip(ctx, c, v.Request, v.ToolResults)
		failures = append(failures, check(v.Expect, out, v.Request)...)
		observed = observe(out)
	case "cancel_stream":
		out := cancelStream(ctx, c, v.Request, v.CancelAfterDeltas)
		failures = append(failures, check(v.Expect, out, v.Request)...)
		if after := generate(ctx, c, json.RawMessage(`{"model":"tiny","prompt":"still there?","stopping":{"maxTokens":2}}`), 0); after.Err != nil {
			failures = append(failures, fmt.Sprintf("server unhealthy after cancel: %+v", *after.Err))
		}
		observed["cancelled"] = out.Cancelled
	case "batch":
		var reqs []*gengate.Request
		for _, raw := range v.Requests {
			req, err := parseRequest(raw)
			if err != nil {
				return result{Name: v.Name, Failures: []string{err.Error()}, Observed: observed}
			}
			reqs = append(reqs, req)
		}
		items := map[int]*outcome{}
		for item, err := range c.BatchGenerate(ctx, reqs) {
			if err != nil {
				failures = append(failures, err.Error())
				break
			}
			if item.Err != nil {
				items[item.Index] = &outcome{Err: toErrorOut(item.Err)}
			} else {
				items[item.Index] = fromResponse(item.Response)
			}
		}
		wants, _ := v.Expect["items"].([]any)
		var obs []any
		for i, w := range wants {
			got, ok := items[i]
			if !ok {
				failures = append(failures, fmt.Sprintf("item %d missing", i))
				continue
			}
			sub := map[string]any{}
			for k, val := range w.(map[string]any) {
				if k != "ok" {
					sub[k] = val
				}
			}
			for _, f := range check(sub, got, v.Requests[i]) {
				failures = append(failures, fmt.Sprintf("item %d: %s", i, f))
			}
			if got.Err != nil {
				obs = append(obs, got.Err)
			} else {
				obs = append(obs, observe(got))
			}
		}
		observed["items"] = obs
	default:
		failures = append(failures, "unknown call "+v.Call)
	}
	if probed {
		err := awaitAbort(ctx, c, probeName, abandonedBefore)
		if err != nil {
			failures = append(failures, err.Error())
		}
		observed["server_aborted"] = err == nil
	}
	if attemptsProbe != "" {
		n, err := probeCount(ctx, c, attemptsProbe)
		if err != nil {
			failures = append(failures, err.Error())
		} else {
			observed["server_attempts"] = n - attemptsBefore
			if n-attemptsBefore != attemptsWant {
				failures = append(failures, fmt.Sprintf("%d attempts reached the server, expected %d", n-attemptsBefore, attemptsWant))
			}
		}
	}
	if failures == nil {
		failures = []string{}
	}
	return result{Name: v.Name, OK: len(failures) == 0, Failures: failures, Observed: observed}
}

// runWithItsClient runs v with the shared client c, or with a client made for v alone when the
// vector sets client options (closed after).
func runWithItsClient(ctx context.Context, c *gengate.Client, addr string, v vector) result {
	if v.Client == nil {
		return runVector(ctx, c, v)
	}
	opts := []gengate.Option{gengate.WithInsecure()}
	for key, val := range v.Client {
		n, isNumber := val.(float64)
		if key != "max_retries" || !isNumber {
			return result{Name: v.Name, Failures: []string{fmt.Sprintf("unknown client option %s: %v", key, val)}, Observed: map[string]any{}}
		}
		opts = append(opts, gengate.WithMaxRetries(int(n)))
	}
	own, err := gengate.Dial(addr, opts...)
	if err != nil {
		return result{Name: v.Name, Failures: []string{err.Error()}, Observed: map[string]any{}}
	}
	defer own.Close()
	return runVector(ctx, own, v)
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: conformance ADDRESS VECTORS")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var doc struct {
		Vectors []vector `json:"vectors"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	c, err := gengate.Dial(os.Args[1], gengate.WithInsecure())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	results := []result{}
	for _, v := range doc.Vectors {
		results = append(results, runWithItsClient(ctx, c, os.Args[1], v))
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	_ = enc.Encode(map[string]any{"language": "go", "results": results})
}
