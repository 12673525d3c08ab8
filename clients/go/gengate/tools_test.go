package gengate_test

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

type weatherArgs struct {
	City  string `json:"city" jsonschema:"description=The city to look up"`
	Units string `json:"units,omitempty" jsonschema:"enum=celsius,enum=fahrenheit"`
}

type timeArgs struct {
	Zone string `json:"zone"`
}

func mustTool[T any](t *testing.T, name, description string) *gengate.Tool {
	t.Helper()
	tool, err := gengate.ToolFor[T](name, description)
	if err != nil {
		t.Fatal(err)
	}
	return tool
}

func TestToolForSendsTheStructsSchemaAsParameters(t *testing.T) {
	tool := mustTool[weatherArgs](t, "get_weather", "Current weather")
	if tool.GetName() != "get_weather" || tool.GetDescription() != "Current weather" || tool.GetStrict() {
		t.Fatalf("tool %v", tool)
	}
	var schema map[string]any
	if err := json.Unmarshal([]byte(tool.GetParametersJson()), &schema); err != nil {
		t.Fatal(err)
	}
	if schema["type"] != "object" || schema["additionalProperties"] != false {
		t.Fatalf("not a closed object schema: %s", tool.GetParametersJson())
	}
	if !reflect.DeepEqual(schema["required"], []any{"city"}) {
		t.Fatalf("required %v, want [city] (units is omitempty)", schema["required"])
	}
	// Properties in the struct's field order, as SchemaFor gives them to structured output.
	if i, j := strings.Index(tool.GetParametersJson(), `"city"`), strings.Index(tool.GetParametersJson(), `"units"`); i < 0 || j < i {
		t.Fatalf("properties out of field order: %s", tool.GetParametersJson())
	}
	want, _ := gengate.SchemaFor[weatherArgs]()
	if tool.GetParametersJson() != string(want) {
		t.Fatalf("parameters %s, SchemaFor %s", tool.GetParametersJson(), want)
	}
}

func TestToolChoicesAndParallelCallsTravelOnTheRequest(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	weather, clock := mustTool[weatherArgs](t, "get_weather", ""), mustTool[timeArgs](t, "get_time", "")
	cases := []struct {
		name   string
		opts   gengate.ToolOptions
		choice *gengatev1.ToolChoice
		calls  []string
	}{
		{"default", gengate.ToolOptions{}, nil, []string{"get_weather", "get_time"}},
		{"auto", gengate.ToolOptions{Choice: gengate.ToolChoiceAuto()},
			&gengatev1.ToolChoice{Choice: &gengatev1.ToolChoice_Mode{Mode: gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_AUTO}},
			[]string{"get_weather", "get_time"}},
		{"required, one call", gengate.ToolOptions{Choice: gengate.ToolChoiceRequired(), ParallelToolCalls: gengate.Ptr(false)},
			&gengatev1.ToolChoice{Choice: &gengatev1.ToolChoice_Mode{Mode: gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_REQUIRED}},
			[]string{"get_weather"}},
		{"named", gengate.ToolOptions{Choice: gengate.ToolChoiceNamed("get_time")},
			&gengatev1.ToolChoice{Choice: &gengatev1.ToolChoice_Name{Name: "get_time"}},
			[]string{"get_time"}},
		{"none", gengate.ToolOptions{Choice: gengate.ToolChoiceNone()},
			&gengatev1.ToolChoice{Choice: &gengatev1.ToolChoice_Mode{Mode: gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_NONE}},
			nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := gengate.WithTools(gengate.Prompt("tiny", "weather and time?"), tc.opts, weather, clock)
			resp, err := c.Generate(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			sent := fake.lastRequest()
			if len(sent.GetTools()) != 2 || !proto.Equal(sent.GetTools()[0], weather) || !proto.Equal(sent.GetTools()[1], clock) {
				t.Fatalf("tools sent %v", sent.GetTools())
			}
			if !proto.Equal(sent.GetToolChoice(), tc.choice) {
				t.Fatalf("tool choice sent %v, want %v", sent.GetToolChoice(), tc.choice)
			}
			if (sent.ParallelToolCalls == nil) != (tc.opts.ParallelToolCalls == nil) ||
				(sent.ParallelToolCalls != nil && sent.GetParallelToolCalls() != *tc.opts.ParallelToolCalls) {
				t.Fatalf("parallel_tool_calls sent %v, want %v", sent.ParallelToolCalls, tc.opts.ParallelToolCalls)
			}
			var names []string
			for _, call := range resp.GetGenerations()[0].GetToolCalls() {
				names = append(names, call.GetName())
			}
			if !reflect.DeepEqual(names, tc.calls) {
				t.Fatalf("calls %v, want %v", names, tc.calls)
			}
		})
	}
}

func TestDecodeToolArgumentsIntoTheToolsType(t *testing.T) {
	got, err := gengate.DecodeToolArguments[weatherArgs](&gengate.ToolCall{Id: "c1", Name: "get_weather", ArgumentsJson: `{"city":"Paris","units":"celsius"}`})
	if err != nil || got != (weatherArgs{City: "Paris", Units: "celsius"}) {
		t.Fatalf("decoded %+v, %v", got, err)
	}
	type none struct{}
	if _, err := gengate.DecodeToolArguments[none](&gengate.ToolCall{Name: "ping"}); err != nil {
		t.Fatalf("empty arguments are the empty object: %v", err)
	}
	for _, bad := range []string{`{"units":"celsius"}`, `{"city":"Paris","country":"FR"}`, `{"city":3}`, `{"city":"Paris","units":"kelvin"}`, `not json`, `["Paris"]`} {
		_, err := gengate.DecodeToolArguments[weatherArgs](&gengate.ToolCall{Id: "c2", Name: "get_weather", ArgumentsJson: bad})
		if !errors.Is(err, gengate.ErrInvalidOutput) {
			t.Errorf("%s: error %v, want ErrInvalidOutput", bad, err)
		} else if !strings.Contains(err.Error(), "c2 (get_weather)") {
			t.Errorf("%s: the error does not name the call: %v", bad, err)
		}
	}
}

func TestWithToolResultsContinuesTheConversation(t *testing.T) {
	fake, addr := startFake(t, nil)
	fake.toolArguments = map[string]string{"get_weather": `{"city":"Paris"}`, "get_time": `{"zone":"CET"}`}
	c := dial(t, addr)
	ctx := context.Background()
	question := []*gengate.ChatMessage{gengate.Message(gengatev1.Role_ROLE_USER, "weather and time in Paris?")}
	tools := []*gengate.Tool{mustTool[weatherArgs](t, "get_weather", ""), mustTool[timeArgs](t, "get_time", "")}
	resp, err := c.Generate(ctx, gengate.WithTools(gengate.Chat("tiny", question...), gengate.ToolOptions{}, tools...))
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGenerations()[0]
	if g.GetFinishReason() != gengatev1.FinishReason_FINISH_REASON_TOOL_CALLS || len(g.GetToolCalls()) != 2 {
		t.Fatalf("generation %v", g)
	}
	args, err := gengate.DecodeToolArguments[weatherArgs](g.GetToolCalls()[0])
	if err != nil || args.City != "Paris" {
		t.Fatalf("arguments %+v, %v", args, err)
	}
	results := map[string]string{"call_0": "sunny", "call_1": "14:00"}
	messages, err := gengate.WithToolResults(question, g, results)
	if err != nil {
		t.Fatal(err)
	}
	if len(question) != 1 {
		t.Fatalf("the caller's messages were changed: %v", question)
	}
	answer, err := c.Generate(ctx, gengate.WithTools(gengate.Chat("tiny", messages...), gengate.ToolOptions{}, tools...))
	if err != nil {
		t.Fatal(err)
	}
	sent := fake.lastRequest().GetMessages().GetMessages()
	want := []*gengatev1.ChatMessage{
		question[0],
		{Role: gengatev1.Role_ROLE_ASSISTANT, ToolCalls: g.GetToolCalls()},
		gengate.ToolMessage("call_0", "sunny"),
		gengate.ToolMessage("call_1", "14:00"),
	}
	if len(sent) != len(want) {
		t.Fatalf("sent %d messages, want %d: %v", len(sent), len(want), sent)
	}
	for i := range want {
		if !proto.Equal(sent[i], want[i]) {
			t.Fatalf("message %d sent %v, want %v", i, sent[i], want[i])
		}
	}
	if sent[2].GetRole() != gengatev1.Role_ROLE_TOOL || sent[2].GetToolCallId() != "call_0" {
		t.Fatalf("tool message %v", sent[2])
	}
	if text := answer.GetGenerations()[0].GetText(); text != "call_0 get_weather=sunny; call_1 get_time=14:00" {
		t.Fatalf("answer %q", text)
	}
}

func TestWithToolResultsKeepsTextAndReasoningAndRefusesMismatchedResults(t *testing.T) {
	g := &gengate.Generation{
		Text:      "Let me look.",
		ToolCalls: []*gengate.ToolCall{{Id: "a", Name: "get_weather", ArgumentsJson: `{"city":"Paris"}`}},
		Reasoning: &gengatev1.Reasoning{Text: "need the weather", Signatures: []string{"sig"}},
	}
	messages, err := gengate.WithToolResults(nil, g, map[string]string{"a": "sunny"})
	if err != nil {
		t.Fatal(err)
	}
	assistant := messages[0]
	if assistant.GetContent()[0].GetText() != "Let me look." || !proto.Equal(assistant.GetReasoning(), g.GetReasoning()) {
		t.Fatalf("assistant message %v", assistant)
	}
	for name, results := range map[string]map[string]string{
		"a call without a result": {},
		"a result for no call":    {"a": "sunny", "b": "rain"},
	} {
		if _, err := gengate.WithToolResults(nil, g, results); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := gengate.WithToolResults(nil, &gengate.Generation{Text: "hi"}, map[string]string{}); err == nil {
		t.Error("a generation without calls: accepted")
	}
}

func TestStreamToolCallsAssemblesFragmentsAndKeepsTheEndFramesCalls(t *testing.T) {
	fake, addr := startFake(t, nil)
	fake.toolArguments = map[string]string{"get_weather": `{"city":"Paris"}`, "get_time": `{"zone":"CET"}`}
	req := gengate.WithTools(gengate.Prompt("tiny", "weather and time?"), gengate.ToolOptions{},
		mustTool[weatherArgs](t, "get_weather", ""), mustTool[timeArgs](t, "get_time", ""))
	var collected gengate.StreamToolCalls
	fragments, finalBeforeEnd := 0, false
	for frame, err := range dial(t, addr).GenerateStream(context.Background(), req) {
		if err != nil {
			t.Fatal(err)
		}
		if d := frame.GetDelta(); d != nil {
			fragments += len(d.GetToolCalls())
			if _, ok := collected.Final(0); ok {
				finalBeforeEnd = true
			}
		}
		collected.Add(frame)
	}
	if fragments != 4 || finalBeforeEnd {
		t.Fatalf("%d fragments (want 4), final calls before the end frame: %v", fragments, finalBeforeEnd)
	}
	final, ok := collected.Final(0)
	if !ok || len(final) != 2 {
		t.Fatalf("final calls %v (end frame seen: %v)", final, ok)
	}
	partial := collected.Partial(0)
	for i := range final {
		if !proto.Equal(partial[i], final[i]) {
			t.Fatalf("call %d assembled %v, end frame %v", i, partial[i], final[i])
		}
	}
	if final[1].GetId() != "call_1" || final[1].GetArgumentsJson() != `{"zone":"CET"}` {
		t.Fatalf("call %v", final[1])
	}
	if _, ok := collected.Final(1); ok {
		t.Fatal("a generation that never came has final calls")
	}
}
