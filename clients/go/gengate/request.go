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

// Magpie asks an instruction-tuned model to write the user turns itself: the conversation so far
// is rendered in the model's chat format and ended with the pre-query text (the header of a user
// turn), so the model continues as the user; each written turn then gets the model's answer.
// Send it with MagpieRequest; read what was written with Conversation.
type Magpie struct {
	// Template is a preset name, "llama3", "qwen2", "phi3" or "gemma" (that chat format's
	// pre-query text, see the README), or any other text: a custom pre-query text sent exactly as
	// given, as the Python client's Magpie does. No name is refused here: a misspelt preset goes
	// as a template.
	Template string
	// SystemPrompt steers the instructions toward a topic or style ("": none).
	SystemPrompt string
	// Conversation holds the turns already written (user and assistant, built with Message); the
	// next user turn follows them.
	Conversation []*gengatev1.ChatMessage
	// NTurns is how many user turns to write, each followed by the model's answer (0: the
	// server's default, 1; at most 16).
	NTurns uint32
	// OnlyInstruction writes the first user turn only: no answer, NTurns ignored.
	OnlyInstruction bool
	// EndWithUser ends on a user turn: the last one gets no answer.
	EndWithUser bool
}

// magpiePresets maps Magpie.Template's preset names to the proto presets.
var magpiePresets = map[string]gengatev1.MagpiePreset{
	"llama3": gengatev1.MagpiePreset_MAGPIE_PRESET_LLAMA3,
	"qwen2":  gengatev1.MagpiePreset_MAGPIE_PRESET_QWEN2,
	"phi3":   gengatev1.MagpiePreset_MAGPIE_PRESET_PHI3,
	"gemma":  gengatev1.MagpiePreset_MAGPIE_PRESET_GEMMA,
}

// Proto is the gengate.v1 Magpie input m describes: a preset name becomes the preset, any other
// Template the custom template.
func (m Magpie) Proto() *gengatev1.Magpie {
	out := &gengatev1.Magpie{
		Conversation:    m.Conversation,
		OnlyInstruction: m.OnlyInstruction,
		EndWithUser:     m.EndWithUser,
	}
	if preset, ok := magpiePresets[m.Template]; ok {
		out.PreQuery = &gengatev1.Magpie_Preset{Preset: preset}
	} else {
		out.PreQuery = &gengatev1.Magpie_Template{Template: m.Template}
	}
	if m.SystemPrompt != "" {
		out.SystemPrompt = &m.SystemPrompt
	}
	if m.NTurns != 0 {
		out.NTurns = &m.NTurns
	}
	return out
}

// MagpieRequest builds a Magpie request: the model writes the user turns itself. Sampling and
// max_tokens (set on the request as for any other) apply to every turn.
func MagpieRequest(model string, m Magpie) *Request {
	return &Request{Model: model, Input: &gengatev1.GenerateRequest_Magpie{Magpie: m.Proto()}}
}

// Turn is one turn of a Magpie conversation.
type Turn struct {
	Role gengatev1.Role
	Text string
	// OutputTokens is how many tokens the model generated for this turn (0 for given turns).
	OutputTokens uint32
}

// Conversation is a Magpie generation's turns, oldest first: the given conversation, then the
// written turns (the generation's text is the last one). Empty for other requests.
func Conversation(g *Generation) []Turn {
	var turns []Turn
	for _, t := range g.GetConversation() {
		turns = append(turns, Turn{Role: t.GetRole(), Text: t.GetText(), OutputTokens: t.GetOutputTokens()})
	}
	return turns
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
