package gengate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/invopop/jsonschema"
	validator "github.com/santhosh-tekuri/jsonschema/v6"
	"google.golang.org/protobuf/types/known/structpb"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// SchemaFor derives the JSON Schema of T (a struct, usually) from its fields and `json` /
// `jsonschema` tags: fields without `omitempty` are required, other properties are refused.
func SchemaFor[T any]() (map[string]any, error) {
	r := &jsonschema.Reflector{DoNotReference: true, ExpandedStruct: true}
	var zero T
	raw, err := json.Marshal(r.Reflect(&zero))
	if err != nil {
		return nil, err
	}
	var schema map[string]any
	if err := json.Unmarshal(raw, &schema); err != nil {
		return nil, err
	}
	delete(schema, "$schema")
	delete(schema, "$id")
	return schema, nil
}

// JSONSchema constrains output to JSON valid against schema.
func JSONSchema(name string, schema map[string]any) (*Structured, error) {
	s, err := structpb.NewStruct(schema)
	if err != nil {
		return nil, fmt.Errorf("gengate: schema is not JSON: %w", err)
	}
	return &Structured{Kind: &gengatev1.StructuredOutput_JsonSchema{
		JsonSchema: &gengatev1.JsonSchema{Schema: s, Name: name},
	}}, nil
}

// ErrInvalidOutput is wrapped by the error GenerateJSON returns when the server's output does
// not match T's schema (which the server should never let happen).
var ErrInvalidOutput = errors.New("gengate: output does not match the schema")

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
	out, err = DecodeJSON[T](schema, resp.GetGenerations()[0].GetText())
	return out, resp, err
}

// DecodeJSON validates text against schema and decodes it into T.
func DecodeJSON[T any](schema map[string]any, text string) (T, error) {
	var out T
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
