/**
 * The TypeScript client: text, a stream, typed structured output and errors.
 *
 *   npx tsx examples/quickstart.ts localhost:50051
 */
import { z } from "zod";

import { GengateClient, GengateError, prompt } from "../src/index.js";

const client = new GengateClient({ address: process.argv[2] ?? "localhost:50051", timeoutMs: 30_000 });

// Text.
const request = prompt("tiny", "Hello", { stopping: { maxTokens: 16 }, sampling: { seed: 7n } });
const response = await client.generate(request);
console.log("text:", JSON.stringify(response.generations[0]?.text));

// A stream: deltas as tokens are produced, then an end frame with usage. Pass
// { signal } to cancel it, or leave the loop early.
for await (const frame of client.generateStream(request)) {
  if (frame.frame.case === "end") console.log("stream ended after", frame.frame.value.usage?.outputTokens, "tokens");
}

// Typed structured output: the server enforces the schema, zod validates the result.
const Person = z.object({ name: z.string().max(12), age: z.int().min(0).max(150) });
const { object: person } = await client.generateObject(Person, prompt("tiny", "A person:"));
console.log("person:", person.name, person.age);

// Errors carry the gRPC code and the server's details.
try {
  await client.generate(prompt("no-such-model", "Hi"));
} catch (e) {
  if (e instanceof GengateError) console.log("error:", e.codeName, "reason", e.reason);
}
