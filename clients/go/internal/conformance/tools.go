package main

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

// The tool-calling parts of the runner: requests rebuilt with the client's tool helpers, the
// tool_calls check, the calls observed, and the tool_round_trip call.

// typedTools rebuilds a request's tools with the typed helpers (gengate.WithTools and the
// ToolChoice builders), so the vector tests that path; a choice they cannot express is an error.
func typedTools(req *gengate.Request) error {
	if len(req.GetTools()) == 0 {
		return nil
	}
	opts := gengate.ToolOptions{ParallelToolCalls: req.ParallelToolCalls}
	if choice := req.GetToolChoice(); choice != nil {
		switch {
		case choice.GetName() != "":
			opts.Choice = gengate.ToolChoiceNamed(choice.GetName())
		case choice.GetMode() == gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_AUTO:
			opts.Choice = gengate.ToolChoiceAuto()
		case choice.GetMode() == gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_NONE:
			opts.Choice = gengate.ToolChoiceNone()
		case choice.GetMode() == gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_REQUIRED:
			opts.Choice = gengate.ToolChoiceRequired()
		}
	}
	typed := gengate.WithTools(&gengate.Request{}, opts, req.GetTools()...)
	if !proto.Equal(typed.GetToolChoice(), req.GetToolChoice()) {
		return fmt.Errorf("the gengate tool choices cannot express the vector's %v (they build %v)", req.GetToolChoice(), typed.GetToolChoice())
	}
	gengate.WithTools(req, opts, typed.GetTools()...)
	return nil
}

// toolCallOut is one tool call as every runner observes it (ids are the server's: not observed).
type toolCallOut struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments_json"`
}

// checkToolCalls compares generation i's calls with want ([{name, arguments}], arguments as JSON
// values); each call must have an id, unique in the generation.
func checkToolCalls(i int, calls []*gengate.ToolCall, want []any) []string {
	var failures []string
	if len(calls) != len(want) {
		return []string{fmt.Sprintf("generation %d: %d tool calls %v, expected %d", i, len(calls), calls, len(want))}
	}
	ids := map[string]bool{}
	for k, call := range calls {
		w, _ := want[k].(map[string]any)
		var got any
		if err := json.Unmarshal([]byte(call.GetArgumentsJson()), &got); err != nil {
			failures = append(failures, fmt.Sprintf("generation %d call %d: arguments %q are not JSON", i, k, call.GetArgumentsJson()))
		}
		gotJSON, _ := json.Marshal(got)
		wantJSON, _ := json.Marshal(w["arguments"])
		if call.GetName() != w["name"] || string(gotJSON) != string(wantJSON) {
			failures = append(failures, fmt.Sprintf("generation %d call %d: %s(%s), expected %v(%s)", i, k, call.GetName(), call.GetArgumentsJson(), w["name"], wantJSON))
		}
		if call.GetId() == "" || ids[call.GetId()] {
			failures = append(failures, fmt.Sprintf("generation %d call %d: id %q missing or repeated", i, k, call.GetId()))
		}
		ids[call.GetId()] = true
	}
	return failures
}

// observeToolCalls is each generation's calls (name, arguments text), or nil when none has any.
func observeToolCalls(perGeneration [][]*gengate.ToolCall) [][]toolCallOut {
	var out [][]toolCallOut
	some := false
	for _, calls := range perGeneration {
		seen := []toolCallOut{}
		for _, c := range calls {
			seen = append(seen, toolCallOut{Name: c.GetName(), Arguments: c.GetArgumentsJson()})
		}
		some = some || len(seen) > 0
		out = append(out, seen)
	}
	if !some {
		return nil
	}
	return out
}

// toolRoundTrip sends the vector's request, answers its first generation's calls with results
// through gengate.WithToolResults, and sends the conversation on: the outcome is the second call's.
func toolRoundTrip(ctx context.Context, c *gengate.Client, raw json.RawMessage, results map[string]string) *outcome {
	req, err := parseRequest(raw)
	if err != nil {
		return fromErr(err)
	}
	resp, err := c.Generate(ctx, req)
	if err != nil {
		return fromErr(err)
	}
	if len(resp.GetGenerations()) == 0 || len(resp.GetGenerations()[0].GetToolCalls()) == 0 {
		return &outcome{Err: &errorOut{Code: "CLIENT_NO_TOOL_CALL", Reason: "the first response made no tool call", Fields: []string{}}}
	}
	messages, err := gengate.WithToolResults(req.GetMessages().GetMessages(), resp.GetGenerations()[0], results)
	if err != nil {
		return fromErr(err)
	}
	next := cloneRequest(req)
	next.Input = gengate.Chat(req.GetModel(), messages...).Input
	second, err := c.Generate(ctx, next)
	if err != nil {
		return fromErr(err)
	}
	return fromResponse(second)
}

func cloneRequest(req *gengate.Request) *gengate.Request { return proto.Clone(req).(*gengate.Request) }

func textsOrEmpty(t []string) []string {
	if t == nil {
		return []string{}
	}
	return t
}
