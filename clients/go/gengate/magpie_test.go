package gengate_test

import (
	"context"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

func TestMagpieRequestSendsTheTypedInputAndDecodesTheConversation(t *testing.T) {
	fake, addr := startFake(t, nil)
	given := []*gengatev1.ChatMessage{
		gengate.Message(gengatev1.Role_ROLE_USER, "Hi"),
		gengate.Message(gengatev1.Role_ROLE_ASSISTANT, "Hello"),
	}
	req := gengate.MagpieRequest("tiny", gengate.Magpie{
		Template: "qwen2", SystemPrompt: "Ask about cooking.", Conversation: given, NTurns: 2, EndWithUser: true,
	})
	req.Sampling = &gengate.Sampling{Seed: gengate.Ptr[uint64](7)}
	req.N = gengate.Ptr[uint32](2)
	resp, err := dial(t, addr).Generate(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	want := &gengatev1.Magpie{
		PreQuery:     &gengatev1.Magpie_Preset{Preset: gengatev1.MagpiePreset_MAGPIE_PRESET_QWEN2},
		SystemPrompt: gengate.Ptr("Ask about cooking."),
		Conversation: given,
		NTurns:       gengate.Ptr[uint32](2),
		EndWithUser:  true,
	}
	sent := fake.lastRequest()
	if !proto.Equal(sent.GetMagpie(), want) {
		t.Fatalf("sent %v, want %v", sent.GetMagpie(), want)
	}
	if sent.GetModel() != "tiny" || sent.GetSampling().GetSeed() != 7 || sent.GetN() != 2 {
		t.Fatalf("the request's other fields were not sent: %v", sent)
	}
	wantTurns := []gengate.Turn{
		{Role: gengatev1.Role_ROLE_USER, Text: "Hi"},
		{Role: gengatev1.Role_ROLE_ASSISTANT, Text: "Hello"},
		{Role: gengatev1.Role_ROLE_USER, Text: "question 1", OutputTokens: 2},
		{Role: gengatev1.Role_ROLE_ASSISTANT, Text: "answer 1", OutputTokens: 3},
		{Role: gengatev1.Role_ROLE_USER, Text: "question 2", OutputTokens: 2},
	}
	for _, g := range resp.GetGenerations() {
		if got := gengate.Conversation(g); !slices.Equal(got, wantTurns) {
			t.Fatalf("conversation %+v, want %+v", got, wantTurns)
		}
	}
}

func TestMagpieTemplateIsAPresetNameOrSentAsGiven(t *testing.T) {
	presets := map[string]gengatev1.MagpiePreset{
		"llama3": gengatev1.MagpiePreset_MAGPIE_PRESET_LLAMA3,
		"qwen2":  gengatev1.MagpiePreset_MAGPIE_PRESET_QWEN2,
		"phi3":   gengatev1.MagpiePreset_MAGPIE_PRESET_PHI3,
		"gemma":  gengatev1.MagpiePreset_MAGPIE_PRESET_GEMMA,
	}
	for name, preset := range presets {
		m := gengate.Magpie{Template: name}.Proto()
		if _, isPreset := m.GetPreQuery().(*gengatev1.Magpie_Preset); !isPreset || m.GetPreset() != preset {
			t.Errorf("%s: sent %v, want preset %s", name, m.GetPreQuery(), preset)
		}
	}
	// Like the Python client: any other text, a misspelt or capitalised name too, is the template.
	for _, text := range []string{"<|im_start|>user\n", "Qwen2", "llama-3", ""} {
		m := gengate.Magpie{Template: text}.Proto()
		if tpl, isTemplate := m.GetPreQuery().(*gengatev1.Magpie_Template); !isTemplate || tpl.Template != text {
			t.Errorf("%q: sent %v, want it as the template", text, m.GetPreQuery())
		}
	}
	// Zero values are left out: the server's defaults (no system prompt, one turn) apply.
	m := gengate.Magpie{Template: "gemma", OnlyInstruction: true}.Proto()
	if m.SystemPrompt != nil || m.NTurns != nil || m.GetConversation() != nil || !m.GetOnlyInstruction() || m.GetEndWithUser() {
		t.Fatalf("unexpected fields in %v", m)
	}
}

func TestConversationIsEmptyWithoutMagpie(t *testing.T) {
	_, addr := startFake(t, nil)
	resp, err := dial(t, addr).Generate(context.Background(), gengate.Prompt("tiny", "hello"))
	if err != nil {
		t.Fatal(err)
	}
	if got := gengate.Conversation(resp.GetGenerations()[0]); len(got) != 0 {
		t.Fatalf("conversation %v for a prompt request", got)
	}
	if got := gengate.Conversation(nil); got != nil {
		t.Fatalf("conversation %v of no generation", got)
	}
}

func TestMagpieRequestsGoInABatch(t *testing.T) {
	fake, addr := startFake(t, nil)
	reqs := []*gengate.Request{
		gengate.MagpieRequest("tiny", gengate.Magpie{Template: "phi3", OnlyInstruction: true}),
		gengate.Prompt("tiny", "hello"),
	}
	for item, err := range dial(t, addr).BatchGenerate(context.Background(), reqs) {
		if err != nil {
			t.Fatal(err)
		}
		turns := gengate.Conversation(item.Response.GetGenerations()[0])
		if item.Index == 0 && !slices.Equal(turns, []gengate.Turn{{Role: gengatev1.Role_ROLE_USER, Text: "question 1", OutputTokens: 2}}) {
			t.Fatalf("item 0: conversation %+v", turns)
		}
		if item.Index == 1 && len(turns) != 0 {
			t.Fatalf("item 1: conversation %+v", turns)
		}
	}
	if fake.requests[0].GetMagpie().GetPreset() != gengatev1.MagpiePreset_MAGPIE_PRESET_PHI3 {
		t.Fatalf("batch item sent %v", fake.requests[0])
	}
}
