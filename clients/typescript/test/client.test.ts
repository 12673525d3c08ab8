import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { context, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";
import { generate as selfSigned } from "selfsigned";
import { z } from "zod";

import {
  Code,
  FinishReason,
  GengateClient,
  GengateError,
  InvalidOutputError,
  TruncatedOutputError,
  jsonSchema,
  prompt,
  regex,
} from "../src/index.js";
import { startFake, type Fake } from "./fake.js";

/** Waits for an event the fake records; the bound only guards against a hang, it times nothing. */
async function observed(event: Promise<void>, what: string): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  const hang = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(what)), 10_000);
  });
  try {
    await Promise.race([event, hang]);
  } finally {
    clearTimeout(timer);
  }
}

describe("GengateClient against an in-process fake server", () => {
  let fake: Fake;
  let client: GengateClient;
  before(async () => {
    fake = await startFake();
    client = new GengateClient({ address: fake.url, token: "s3cret", metadata: { "x-team": "search" } });
  });
  after(() => fake.close());

  it("generates text and sends the token and metadata", async () => {
    const resp = await client.generate(prompt("tiny", "hello", { n: 2 }));
    assert.equal(resp.generations.length, 2);
    assert.equal(resp.generations[1]?.text, "echo: hello");
    const headers = fake.headers.at(-1)!;
    assert.equal(headers.get("authorization"), "Bearer s3cret");
    assert.equal(headers.get("x-team"), "search");

    await client.generate(prompt("tiny", "again"), { token: "other", metadata: { "x-call": "1" } });
    assert.equal(fake.headers.at(-1)!.get("authorization"), "Bearer other");
    assert.equal(fake.headers.at(-1)!.get("x-call"), "1");
  });

  it("accepts plain-object requests", async () => {
    const resp = await client.generate({ model: "tiny", input: { case: "prompt", value: "plain" }, requestId: "abc" });
    assert.equal(resp.requestId, "abc");
  });

  it("exposes the code, reason and field violations of errors", async () => {
    await assert.rejects(client.generate(prompt("nope", "hi")), (e: unknown) => {
      assert.ok(e instanceof GengateError);
      assert.equal(e.code, Code.NotFound);
      assert.equal(e.codeName, "NOT_FOUND");
      assert.equal(e.reason, "MODEL_NOT_FOUND");
      return true;
    });
    await assert.rejects(client.generate(prompt("tiny", "hi", { structuredOutput: regex("(ab") })), (e: unknown) => {
      assert.ok(e instanceof GengateError);
      assert.equal(e.code, Code.InvalidArgument);
      assert.equal(e.field("structured_output.regex.pattern")?.description, "unbalanced parenthesis");
      assert.match(e.message, /structured_output\.regex\.pattern/);
      return true;
    });
  });

  it("ends a call at its deadline", async () => {
    // The slow call never answers: only the deadline can end it.
    await assert.rejects(client.generate(prompt("tiny", "slow"), { timeoutMs: 100 }), (e: unknown) => {
      assert.ok(e instanceof GengateError);
      assert.equal(e.code, Code.DeadlineExceeded);
      return true;
    });
    await observed(fake.slowEnded, "the server never saw the call end: the deadline reached neither the server nor the connection");
  });

  it("streams start, deltas and end in order", async () => {
    const kinds: string[] = [];
    let text = "";
    for await (const frame of client.generateStream(prompt("tiny", "a b c"))) {
      kinds.push(frame.frame.case ?? "none");
      if (frame.frame.case === "delta") text += frame.frame.value.text;
    }
    assert.deepEqual(kinds, ["start", "delta", "delta", "delta", "end"]);
    assert.equal(text, "a b c ");
  });

  it("cancels the stream on the server when the signal aborts", async () => {
    const controller = new AbortController();
    let deltas = 0;
    await assert.rejects(
      (async () => {
        for await (const frame of client.generateStream(prompt("tiny", "endless"), { signal: controller.signal })) {
          if (frame.frame.case === "delta" && ++deltas === 3) controller.abort();
        }
      })(),
      (e: unknown) => e instanceof GengateError && e.code === Code.Canceled && e.codeName === "CANCELLED",
    );
    await observed(fake.cancelled, "the server saw no cancel");
  });

  it("reports the bad item of a batch alone", async () => {
    const items = [];
    for await (const item of client.batchGenerate([prompt("tiny", "one"), prompt("nope", "two"), prompt("tiny", "three")])) {
      items.push(item);
    }
    items.sort((a, b) => a.index - b.index);
    assert.equal(items.length, 3);
    assert.equal(items[0]?.response?.generations[0]?.text, "echo: one");
    assert.equal(items[1]?.error?.code, Code.NotFound);
    assert.equal(items[1]?.error?.reason, "MODEL_NOT_FOUND");
    assert.equal(items[2]?.error, undefined);
  });

  it("lists models", async () => {
    const models = await client.listModels();
    assert.equal(models[0]?.name, "tiny");
    assert.equal(models[0]?.capabilities?.maxN, 4);
  });

  const Person = z.object({ name: z.string().min(1), age: z.int().min(0).max(150), note: z.string().optional() });

  it("decodes structured output into the zod type and sends its JSON Schema", async () => {
    const { object, response } = await client.generateObject(Person, prompt("tiny", "a person"), { name: "person" });
    const typed: { name: string; age: number } = object;
    assert.deepEqual(typed, { name: "Ada", age: 36 });
    assert.equal(response.model, "tiny");
    const sent = fake.requests.at(-1)!.structuredOutput?.kind;
    assert.equal(sent?.case, "jsonSchema");
    if (sent?.case !== "jsonSchema") return;
    assert.equal(sent.value.name, "person");
    assert.equal(sent.value.schema, undefined, "the schema must travel as schemaJson, not as a Struct");
    const schema = JSON.parse(sent.value.schemaJson) as { type: string; required: string[]; properties: Record<string, { maximum?: number }>; additionalProperties: boolean };
    assert.deepEqual(Object.keys(schema.properties), ["name", "age", "note"]);
    assert.ok(sent.value.schemaJson.indexOf('"name"') < sent.value.schemaJson.indexOf('"age"'));
    assert.equal(schema.type, "object");
    assert.deepEqual(schema.required, ["name", "age"]);
    assert.equal(schema.properties["age"]?.maximum, 150);
    assert.equal(schema.additionalProperties, false);
  });

  it("sends a schema given as text exactly as written", async () => {
    const text = '{"type":"object","properties":{"zeta":{"type":"integer","maximum":9007199254740993},"10":{"type":"string"}}}';
    await client.generate(prompt("tiny", "x", { structuredOutput: jsonSchema(text, "big") }));
    const sent = fake.requests.at(-1)!.structuredOutput?.kind;
    assert.equal(sent?.case, "jsonSchema");
    if (sent?.case !== "jsonSchema") return;
    assert.equal(sent.value.schemaJson, text);
    assert.equal(sent.value.schema, undefined);
    assert.throws(() => jsonSchema("[1]"), TypeError);
  });

  it("refuses output outside the schema", async () => {
    for (const bad of ['{"name":"Ada","age":501}', '{"name":"Ada"}', "not json"]) {
      fake.jsonText = bad;
      await assert.rejects(client.generateObject(Person, prompt("tiny", "x")), InvalidOutputError);
    }
    fake.jsonText = '{"name":"Ada","age":36}';
  });

  it("reports a generation cut at maxTokens as truncated, before parsing", async () => {
    fake.jsonFinish = FinishReason.LENGTH;
    try {
      for (const text of ['{"name":"Ad', '{"name":"Ada","age":36}']) {
        fake.jsonText = text;
        await assert.rejects(client.generateObject(Person, prompt("tiny", "x")), (e: unknown) => {
          assert.ok(e instanceof TruncatedOutputError && !(e instanceof InvalidOutputError));
          assert.equal(e.text, text);
          return true;
        });
      }
    } finally {
      fake.jsonFinish = undefined;
      fake.jsonText = '{"name":"Ada","age":36}';
    }
  });
});

describe("tracing", () => {
  it("sends a traceparent naming the client span, in the caller's trace", async () => {
    const fake = await startFake();
    const contextManager = new AsyncLocalStorageContextManager().enable();
    context.setGlobalContextManager(contextManager);
    try {
      const exporter = new InMemorySpanExporter();
      const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
      const client = new GengateClient({ address: fake.url, tracerProvider: provider });
      const parent = provider.getTracer("test").startSpan("caller");
      await context.with(trace.setSpan(context.active(), parent), () => client.generate(prompt("tiny", "traced")));
      for await (const _ of client.generateStream(prompt("tiny", "a b"))) void _;
      parent.end();

      const header = fake.headers[0]!.get("traceparent");
      assert.ok(header, "no traceparent header");
      const [version, traceId, spanId] = header.split("-");
      assert.equal(version, "00");
      assert.match(traceId!, /^[0-9a-f]{32}$/);
      const spans = exporter.getFinishedSpans();
      const rpc = spans.find((s) => s.name === "gengate.v1.GenerationService/Generate");
      assert.ok(rpc, `no client span in ${spans.map((s) => s.name).join(",")}`);
      assert.equal(traceId, rpc.spanContext().traceId);
      assert.equal(traceId, parent.spanContext().traceId);
      assert.equal(spanId, rpc.spanContext().spanId);
      assert.equal(rpc.parentSpanContext?.spanId, parent.spanContext().spanId);
      assert.equal(rpc.attributes["rpc.grpc.status_code"], 0);
      const stream = spans.find((s) => s.name === "gengate.v1.GenerationService/GenerateStream");
      assert.ok(stream, "the stream span was never ended");
      assert.equal(fake.headers[1]!.get("traceparent")?.split("-")[2], stream.spanContext().spanId);
    } finally {
      context.disable();
      await fake.close();
    }
  });
});

describe("TLS", () => {
  it("talks TLS to a server whose CA it is given, and refuses one it does not trust", async () => {
    // A self-signed CA certificate for localhost and 127.0.0.1, made in-process as the Go tests make theirs.
    const now = new Date();
    const pems = await selfSigned([{ name: "commonName", value: "localhost" }], {
      keyType: "ec",
      curve: "P-256",
      algorithm: "sha256",
      notBeforeDate: new Date(now.getTime() - 3_600_000),
      notAfterDate: new Date(now.getTime() + 3_600_000),
      extensions: [
        { name: "basicConstraints", cA: true, critical: true },
        { name: "keyUsage", digitalSignature: true, keyCertSign: true, critical: true },
        { name: "extKeyUsage", serverAuth: true },
        { name: "subjectAltName", altNames: [{ type: 2, value: "localhost" }, { type: 7, ip: "127.0.0.1" }] },
      ],
    });
    const cert = Buffer.from(pems.cert);
    const fake = await startFake({ cert, key: pems.private });
    try {
      const client = new GengateClient({ address: fake.url, tls: { ca: cert }, token: "t" });
      const resp = await client.generate(prompt("tiny", "over tls"));
      assert.equal(resp.generations[0]?.text, "echo: over tls");
      assert.equal(fake.headers.at(-1)!.get("authorization"), "Bearer t");
      const untrusting = new GengateClient({ address: fake.url, tls: true });
      await assert.rejects(untrusting.generate(prompt("tiny", "x")), (e: unknown) => e instanceof GengateError && /certificate/.test(e.message));
    } finally {
      await fake.close();
    }
  });
});
