/**
 * Client span → server RPC span → backend span, one trace, against a live server started with
 * GENGATE_TRACES_FILE. clients/conformance/run sets GENGATE_E2E_ADDRESS and
 * GENGATE_E2E_TRACES_FILE; without them the test is skipped.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { describe, it } from "node:test";

import { context, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";

import { GengateClient, prompt } from "../src/index.js";

interface ServerSpan {
  name: string;
  kind: string;
  trace_id: string;
  span_id: string;
  parent_span_id: string | null;
  attributes: Record<string, unknown>;
}

const address = process.env["GENGATE_E2E_ADDRESS"];
const tracesFile = process.env["GENGATE_E2E_TRACES_FILE"];
const model = process.env["GENGATE_E2E_MODEL"] ?? "tiny";

function readSpans(path: string, traceId: string): ServerSpan[] {
  let text = "";
  try {
    text = readFileSync(path, "utf8");
  } catch {
    return [];
  }
  return text
    .split("\n")
    .filter((line) => line.trim() !== "")
    .map((line) => JSON.parse(line) as ServerSpan)
    .filter((s) => s.trace_id === traceId);
}

/** The SERVER span under the client span and the spans under it; waits, as the server span may end after the reply. */
async function serverTraceUnder(path: string, traceId: string, clientSpanId: string): Promise<{ server: ServerSpan; children: ServerSpan[] }> {
  let spans: ServerSpan[] = [];
  for (let i = 0; i < 250; i++) {
    spans = readSpans(path, traceId);
    for (const server of spans.filter((s) => s.kind === "SERVER" && s.parent_span_id === clientSpanId)) {
      const children = spans.filter((s) => s.parent_span_id === server.span_id);
      if (children.length > 0) return { server, children };
    }
    await sleep(20);
  }
  assert.fail(`no server span under client span ${clientSpanId} with a child in trace ${traceId}: ${JSON.stringify(spans)}`);
}

describe("trace through the real server", { skip: !address || !tracesFile ? "needs GENGATE_E2E_ADDRESS and GENGATE_E2E_TRACES_FILE (clients/conformance/run)" : false }, () => {
  it("client span → server RPC span → backend span, for unary and streaming calls", async () => {
    const contextManager = new AsyncLocalStorageContextManager().enable();
    context.setGlobalContextManager(contextManager);
    try {
      const exporter = new InMemorySpanExporter();
      const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
      const client = new GengateClient({ address: address!, tracerProvider: provider });
      const request = prompt(model, "CANARY-ts-e2e a short story", { stopping: { maxTokens: 6 } });
      const caller = provider.getTracer("test").startSpan("caller");
      const { unaryTokens, streamTokens } = await context.with(trace.setSpan(context.active(), caller), async () => {
        const response = await client.generate(request);
        let streamed = 0;
        for await (const frame of client.generateStream(request)) {
          if (frame.frame.case === "end") streamed += frame.frame.value.usage?.outputTokens ?? 0;
        }
        return { unaryTokens: response.usage?.outputTokens ?? 0, streamTokens: streamed };
      });
      caller.end();
      const traceId = caller.spanContext().traceId;

      for (const [method, outputTokens] of [["Generate", unaryTokens], ["GenerateStream", streamTokens]] as const) {
        const client = exporter.getFinishedSpans().find((s) => s.name === `gengate.v1.GenerationService/${method}`);
        assert.ok(client, `no client span for ${method}`);
        assert.equal(client.spanContext().traceId, traceId);
        assert.equal(client.parentSpanContext?.spanId, caller.spanContext().spanId);
        const { server, children } = await serverTraceUnder(tracesFile!, traceId, client.spanContext().spanId);
        assert.ok(server.name.endsWith(`GenerationService/${method}`), server.name);
        const backend = children[0]!;
        assert.equal(backend.kind, "CLIENT");
        assert.equal(backend.attributes["gen_ai.request.model"], model);
        assert.ok(outputTokens > 0);
        assert.equal(backend.attributes["gen_ai.usage.output_tokens"], outputTokens);
        assert.ok(Array.isArray(backend.attributes["gen_ai.response.finish_reasons"]));
        assert.ok(!JSON.stringify(backend.attributes).includes("CANARY"), "the prompt was recorded");
      }
    } finally {
      context.disable();
    }
  });
});
