package gengate

import (
	"fmt"
	"slices"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// The generated tool-calling types, under shorter names.
type (
	// Tool is a function the model may call: Name, Description, ParametersJSON (its arguments'
	// JSON Schema as JSON text; empty: no arguments) and Strict (the provider's strict mode).
	Tool          = gengatev1.Tool
	ToolChoice    = gengatev1.ToolChoice
	ToolCall      = gengatev1.ToolCall
	ToolCallDelta = gengatev1.ToolCallDelta
	ChatMessage   = gengatev1.ChatMessage
)

// ToolFor is a tool whose arguments are shaped like T: its parameters are T's JSON Schema, as
// SchemaFor derives it (the same path GenerateJSON uses). Decode a call with
// DecodeToolArguments[T].
func ToolFor[T any](name, description string) (*Tool, error) {
	schema, err := SchemaFor[T]()
	if err != nil {
		return nil, err
	}
	return &Tool{Name: name, Description: description, ParametersJson: string(schema)}, nil
}

// ToolChoiceAuto lets the model answer in text or call tools (the server's default with tools).
func ToolChoiceAuto() *ToolChoice {
	return toolChoiceMode(gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_AUTO)
}

// ToolChoiceNone forbids tool calls: the tools are context only.
func ToolChoiceNone() *ToolChoice {
	return toolChoiceMode(gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_NONE)
}

// ToolChoiceRequired makes the model call at least one tool.
func ToolChoiceRequired() *ToolChoice {
	return toolChoiceMode(gengatev1.ToolChoiceMode_TOOL_CHOICE_MODE_REQUIRED)
}

// ToolChoiceNamed makes the model call exactly the tool named name (one of the request's tools).
func ToolChoiceNamed(name string) *ToolChoice {
	return &ToolChoice{Choice: &gengatev1.ToolChoice_Name{Name: name}}
}

func toolChoiceMode(mode gengatev1.ToolChoiceMode) *ToolChoice {
	return &ToolChoice{Choice: &gengatev1.ToolChoice_Mode{Mode: mode}}
}

// ToolOptions are a request's tool settings beside its tools (zero: the server's defaults).
type ToolOptions struct {
	// Choice says whether and which tool must be called (nil: auto).
	Choice *ToolChoice
	// ParallelToolCalls allows (true) or forbids (false) several calls in one turn (nil: the
	// backend's default).
	ParallelToolCalls *bool
}

// WithTools offers tools on req (replacing any it had) with opts, and returns req, so a request
// builds in one expression: gengate.WithTools(gengate.Chat(...), opts, weather).
func WithTools(req *Request, opts ToolOptions, tools ...*Tool) *Request {
	req.Tools = tools
	req.ToolChoice = opts.Choice
	req.ParallelToolCalls = opts.ParallelToolCalls
	return req
}

// DecodeToolArguments validates a call's arguments against T's schema (SchemaFor) and decodes
// them into T; empty arguments are the empty object. The error wraps ErrInvalidOutput when they
// do not match, which the server's own validation should never let happen for a ToolFor[T] tool.
func DecodeToolArguments[T any](call *ToolCall) (T, error) {
	schema, err := SchemaFor[T]()
	if err != nil {
		var zero T
		return zero, err
	}
	arguments := call.GetArgumentsJson()
	if arguments == "" {
		arguments = "{}"
	}
	out, err := DecodeJSON[T](schema, arguments)
	if err != nil {
		return out, fmt.Errorf("tool call %s (%s): %w", call.GetId(), call.GetName(), err)
	}
	return out, nil
}

// ToolMessage is the ROLE_TOOL message answering the call whose id is callID with result.
func ToolMessage(callID, result string) *ChatMessage {
	msg := Message(gengatev1.Role_ROLE_TOOL, result)
	msg.ToolCallId = callID
	return msg
}

// AssistantMessage is the assistant turn g was, to send back in a conversation: its text (if
// any), its tool calls and its reasoning.
func AssistantMessage(g *Generation) *ChatMessage {
	msg := &ChatMessage{Role: gengatev1.Role_ROLE_ASSISTANT, ToolCalls: g.GetToolCalls()}
	if g.GetText() != "" {
		msg.Content = Message(gengatev1.Role_ROLE_ASSISTANT, g.GetText()).GetContent()
	}
	if r := g.GetReasoning(); r != nil {
		msg.Reasoning = r
	}
	return msg
}

// WithToolResults continues a conversation after g called tools: a copy of messages with g's
// assistant turn (AssistantMessage) and one ROLE_TOOL message per call, in the calls' order,
// holding results[call id]. Every call needs a result and every result a call of g.
func WithToolResults(messages []*ChatMessage, g *Generation, results map[string]string) ([]*ChatMessage, error) {
	calls := g.GetToolCalls()
	if len(calls) == 0 {
		return nil, fmt.Errorf("gengate: generation %d made no tool call", g.GetIndex())
	}
	ids := map[string]bool{}
	out := append(slices.Clone(messages), AssistantMessage(g))
	for _, call := range calls {
		result, ok := results[call.GetId()]
		if !ok {
			return nil, fmt.Errorf("gengate: no result for tool call %s (%s)", call.GetId(), call.GetName())
		}
		ids[call.GetId()] = true
		out = append(out, ToolMessage(call.GetId(), result))
	}
	for id := range results {
		if !ids[id] {
			return nil, fmt.Errorf("gengate: a result for %q, which is no tool call of generation %d", id, g.GetIndex())
		}
	}
	return out, nil
}

// StreamToolCalls collects a stream's tool calls per generation: the fragments as they arrive
// (Partial), then each end frame's complete calls, the ones the server validated (Final).
// Feed it every frame with Add.
type StreamToolCalls struct {
	partial map[uint32][]*ToolCall
	final   map[uint32][]*ToolCall
}

// Add takes one frame: a delta's fragments are appended to their calls, an end frame's calls
// become its generation's final calls. Other frames are ignored.
func (s *StreamToolCalls) Add(frame *Frame) {
	if s.partial == nil {
		s.partial, s.final = map[uint32][]*ToolCall{}, map[uint32][]*ToolCall{}
	}
	if d := frame.GetDelta(); d != nil {
		calls := s.partial[d.GetIndex()]
		for _, fragment := range d.GetToolCalls() {
			for int(fragment.GetIndex()) >= len(calls) {
				calls = append(calls, &ToolCall{})
			}
			call := calls[fragment.GetIndex()]
			if fragment.GetId() != "" {
				call.Id = fragment.GetId()
			}
			if fragment.GetName() != "" {
				call.Name = fragment.GetName()
			}
			call.ArgumentsJson += fragment.GetArgumentsFragment()
		}
		s.partial[d.GetIndex()] = calls
	}
	if e := frame.GetEnd(); e != nil {
		s.final[e.GetIndex()] = e.GetToolCalls()
	}
}

// Partial is generation index's calls assembled from the fragments so far: not validated yet, and
// an id may be empty where the backend gave none (the end frame carries the server's).
func (s *StreamToolCalls) Partial(index uint32) []*ToolCall { return s.partial[index] }

// Final is generation index's complete, validated calls from its end frame; ok is false until
// that frame has come.
func (s *StreamToolCalls) Final(index uint32) (calls []*ToolCall, ok bool) {
	calls, ok = s.final[index]
	return calls, ok
}
