package gengate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/invopop/jsonschema"
	validator "github.com/santhosh-tekuri/jsonschema/v6"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// SchemaFor derives the JSON Schema of T (a struct, usually) from its fields and `json` /
// `jsonschema` tags: fields without `omitempty` are required, other properties are refused.
// It is JSON text, properties in the struct's field order (a model writes them in that order).
func SchemaFor[T any]() ([]byte, error) {
	r := &jsonschema.Reflector{DoNotReference: true, ExpandedStruct: true}
	var zero T
	schema := r.Reflect(&zero)
	schema.Version = ""
	schema.ID = ""
	return json.Marshal(schema)
}

// JSONSchema constrains output to JSON valid against schemaJSON, a JSON Schema as JSON text.
// The text travels as is (JsonSchema.schema_json), so property order and exact numbers are kept.
func JSONSchema(name string, schemaJSON []byte) (*Structured, error) {
	var object map[string]json.RawMessage
	if err := json.Unmarshal(schemaJSON, &object); err != nil || object == nil {
		return nil, fmt.Errorf("gengate: schema is not a JSON object: %v", err)
	}
	return &Structured{Kind: &gengatev1.StructuredOutput_JsonSchema{
		JsonSchema: &gengatev1.JsonSchema{SchemaJson: string(schemaJSON), Name: name},
	}}, nil
}

// ErrInvalidOutput is wrapped by the error GenerateJSON returns when the server's output does
// not match T's schema (which the server should never let happen).
var ErrInvalidOutput = errors.New("gengate: output does not match the schema")

// ErrTruncatedOutput is wrapped by the error GenerateJSON and DecodeGeneration return when the
// generation was cut at max_tokens (finish reason LENGTH) before its structure was complete:
// raise max_tokens. Checked before any parse, as the Python and TypeScript clients do.
var ErrTruncatedOutput = errors.New("gengate: output was cut at max_tokens before it was complete")

// GenerateJSON asks for output shaped like T: it derives T's JSON Schema, sends it as the
// request's structured output (the request itself is not modified), validates the first
// generation against the schema and decodes it into T.
func GenerateJSON[T any](ctx context.Context, c *Client, req *Request, opts ...CallOption) (T, *Response, error) {
	var out T
	schema, err := SchemaFor[T]()
	if err != nil {
		return out, nil, err
	}
	structured, err := JSONSchema(schemaName[T](), schema)
	if err != nil {
		return out, nil, err
	}
	req = cloneRequest(req)
	structured.Options = req.GetStructuredOutput().GetOptions()
	req.StructuredOutput = structured
	resp, err := c.Generate(ctx, req, opts...)
	if err != nil {
		return out, nil, err
	}
	if len(resp.GetGenerations()) == 0 {
		return out, resp, fmt.Errorf("%w: no generation", ErrInvalidOutput)
	}
	out, err = DecodeGeneration[T](schema, resp.GetGenerations()[0])
	return out, resp, err
}

// DecodeGeneration decodes one generation of a structured request into T: ErrTruncatedOutput
// when it was cut at max_tokens, else as DecodeJSON.
func DecodeGeneration[T any](schemaJSON []byte, g *gengatev1.Generation) (T, error) {
	if g.GetFinishReason() == gengatev1.FinishReason_FINISH_REASON_LENGTH {
		var out T
		return out, fmt.Errorf("%w: generation %d stopped at %d tokens; raise max_tokens",
			ErrTruncatedOutput, g.GetIndex(), g.GetOutputTokens())
	}
	return DecodeJSON[T](schemaJSON, g.GetText())
}

// DecodeJSON validates text against schemaJSON (a JSON Schema as JSON text) and decodes it into T.
func DecodeJSON[T any](schemaJSON []byte, text string) (T, error) {
	var out T
	schema, err := validator.UnmarshalJSON(bytes.NewReader(schemaJSON))
	if err != nil {
		return out, fmt.Errorf("gengate: schema is not JSON: %w", err)
	}
	compiler := validator.NewCompiler()
	if err := compiler.AddResource("gengate://schema.json", schema); err != nil {
		return out, err
	}
	compiled, err := compiler.Compile("gengate://schema.json")
	if err != nil {
		return out, err
	}
	doc, err := validator.UnmarshalJSON(strings.NewReader(text))
	if err != nil {
		return out, fmt.Errorf("%w: %v", ErrInvalidOutput, err)
	}
	if err := compiled.Validate(doc); err != nil {
		return out, fmt.Errorf("%w: %v", ErrInvalidOutput, err)
	}
	if err := json.Unmarshal([]byte(text), &out); err != nil {
		return out, fmt.Errorf("%w: %v", ErrInvalidOutput, err)
	}
	return out, nil
}

func schemaName[T any]() string {
	name := fmt.Sprintf("%T", *new(T))
	if i := strings.LastIndexAny(name, ".]"); i >= 0 {
		name = name[i+1:]
	}
	if name == "" {
		return "output"
	}
	return name
}
