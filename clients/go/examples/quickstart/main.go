// Command quickstart shows the Go client: text, a stream, typed structured output and errors.
//
//	go run ./examples/quickstart localhost:50051
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/gengate/gengate/clients/go/gengate"
)

// Person is the shape the model must answer with; its JSON Schema comes from the struct.
type Person struct {
	Name string `json:"name" jsonschema:"maxLength=12"`
	Age  int    `json:"age" jsonschema:"minimum=0,maximum=150"`
}

func main() {
	addr := "localhost:50051"
	if len(os.Args) > 1 {
		addr = os.Args[1]
	}
	client, err := gengate.Dial(addr, gengate.WithInsecure()) // gengate.WithTLS(nil) for TLS
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Text.
	req := gengate.Prompt("tiny", "Hello")
	req.Stopping = &gengate.Stopping{MaxTokens: gengate.Ptr[uint32](16)}
	req.Sampling = &gengate.Sampling{Seed: gengate.Ptr[uint64](7)}
	resp, err := client.Generate(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("text: %q\n", resp.GetGenerations()[0].GetText())

	// A stream: deltas as tokens are produced, then an end frame with usage.
	for frame, err := range client.GenerateStream(ctx, req) {
		if err != nil {
			log.Fatal(err)
		}
		if end := frame.GetEnd(); end != nil {
			fmt.Printf("stream ended: %s after %d tokens\n", end.GetFinishReason(), end.GetUsage().GetOutputTokens())
		}
	}

	// Typed structured output: the server enforces Person's schema, the client validates it.
	person, _, err := gengate.GenerateJSON[Person](ctx, client, gengate.Prompt("tiny", "A person:"))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("person: %+v\n", person)

	// Errors carry the gRPC code and the server's details.
	_, err = client.Generate(ctx, gengate.Prompt("no-such-model", "Hi"))
	var gerr *gengate.Error
	if errors.As(err, &gerr) {
		fmt.Printf("error: %s, reason %s\n", gerr.Code, gerr.Reason)
	}
}
