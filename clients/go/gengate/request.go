package gengate

import (
	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// Prompt builds a request for raw prompt text.
func Prompt(model, prompt string) *Request {
	return &Request{Model: model, Input: &gengatev1.GenerateRequest_Prompt{Prompt: prompt}}
}

// Chat builds a request from alternating text messages, system first if given.
func Chat(model string, messages ...*gengatev1.ChatMessage) *Request {
	return &Request{Model: model, Input: &gengatev1.GenerateRequest_Messages{
		Messages: &gengatev1.ChatMessages{Messages: messages},
	}}
}

// Message is one text chat message.
func Message(role gengatev1.Role, text string) *gengatev1.ChatMessage {
	return &gengatev1.ChatMessage{Role: role, Content: []*gengatev1.ContentPart{
		{Part: &gengatev1.ContentPart_Text{Text: text}},
	}}
}

// Regex constrains output to a full match of pattern.
func Regex(pattern string) *Structured {
	return &Structured{Kind: &gengatev1.StructuredOutput_Regex{Regex: &gengatev1.Regex{Pattern: pattern}}}
}

// Choice constrains output to exactly one of choices.
func Choice(choices ...string) *Structured {
	return &Structured{Kind: &gengatev1.StructuredOutput_Choice{Choice: &gengatev1.Choice{Choices: choices}}}
}

// LarkGrammar constrains output to a sentence of a Lark grammar.
func LarkGrammar(definition string) *Structured {
	return &Structured{Kind: &gengatev1.StructuredOutput_Grammar{Grammar: &gengatev1.Grammar{
		Syntax: gengatev1.GrammarSyntax_GRAMMAR_SYNTAX_LARK, Definition: definition,
	}}}
}

// JSONObject constrains output to any JSON object.
func JSONObject() *Structured {
	return &Structured{Kind: &gengatev1.StructuredOutput_JsonObject{JsonObject: &gengatev1.JsonObject{}}}
}

// Ptr returns a pointer to v, for the optional fields of Sampling and Stopping.
func Ptr[T any](v T) *T { return &v }

func cloneRequest(req *Request) *Request { return proto.Clone(req).(*Request) }
