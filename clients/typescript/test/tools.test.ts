import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { create, equals } from "@bufbuild/protobuf";
import { z } from "zod";

import {
  ChatMessageSchema,
  FinishReason,
  GenerationSchema,
  GengateClient,
  InvalidOutputError,
  Role,
  StreamToolCalls,
  ToolCallSchema,
  ToolChoiceMode,
  ToolChoiceSchema,
  ToolSchema,
  parseToolCalls,
  prompt,
  schemaFromZod,
  tool,
  toolChoice,
  toolMessage,
  withToolResults,
  withTools,
  type ChatMessageInit,
  type ToolCall,
} from "../src/index.js";
import { startFake, type Fake } from "./fake.js";

const weather = tool({
  name: "get_weather",
  description: "Current weather",
  parameters: z.object({ city: z.string().describe("The city"), units: z.enum(["celsius", "fahrenheit"]).optional() }),
});
const clock = tool({ name: "get_time", parameters: z.object({ zone: z.string() }) });

const call = (name: string, argumentsJson: string, id = "c1"): ToolCall => create(ToolCallSchema, { id, name, argumentsJson });

describe("tool()", () => {
  it("sends the zod schema's JSON Schema, as structured output does", () => {
    assert.equal(weather.parametersJson, JSON.stringify(schemaFromZod(weather.parameters)));
    const schema = JSON.parse(weather.parametersJson) as Record<string, unknown>;
    assert.equal(schema["type"], "object");
    assert.equal(schema["additionalProperties"], false);
    assert.deepEqual(schema["required"], ["city"]);
    assert.equal("$schema" in schema, false);
    const sent = create(ToolSchema, weather);
    assert.ok(
      equals(ToolSchema, sent, create(ToolSchema, { name: "get_weather", description: "Current weather", parametersJson: weather.parametersJson })),
      `a tool is the Tool it describes, nothing more: ${JSON.stringify(sent)}`,
    );
    assert.equal(create(ToolSchema, tool({ name: "t", parameters: z.object({}), strict: true })).strict, true);
  });

  it("parses a call's arguments typed by the schema, and refuses what does not match", () => {
    const args: { city: string; units?: "celsius" | "fahrenheit" | undefined } = weather.parse(call("get_weather", '{"city":"Paris","units":"celsius"}'));
    assert.deepEqual(args, { city: "Paris", units: "celsius" });
    assert.deepEqual(tool({ name: "ping", parameters: z.object({}) }).parse(call("ping", "")), {});
    for (const bad of ['{"units":"celsius"}', '{"city":3}', '{"city":"Paris","units":"kelvin"}', "not json"]) {
      assert.throws(() => weather.parse(call("get_weather", bad, "c7")), (e: unknown) => e instanceof InvalidOutputError && /c7 \(get_weather\)/.test(e.message), bad);
    }
    assert.throws(() => weather.parse(call("get_time", "{}")), InvalidOutputError);
  });

  it("parseToolCalls types each call by the tool it names", () => {
    const generation = create(GenerationSchema, {
      toolCalls: [call("get_time", '{"zone":"CET"}', "a"), call("get_weather", '{"city":"Rome"}', "b")],
    });
    const parsed = parseToolCalls(generation, [weather, clock]);
    const seen: string[] = [];
    for (const c of parsed) {
      if (c.name === "get_weather") seen.push(`${c.id}:${c.arguments.city}`);
      else seen.push(`${c.id}:${c.arguments.zone}`);
    }
    assert.deepEqual(seen, ["a:CET", "b:Rome"]);
    assert.deepEqual(parseToolCalls(undefined, [weather]), []);
    assert.throws(() => parseToolCalls([call("delete_all", "{}")], [weather, clock]), /none of get_weather, get_time/);
  });
});

describe("toolChoice and withTools", () => {
  it("maps each choice to the proto one", () => {
    const cases: [Parameters<typeof toolChoice>[0], unknown][] = [
      ["auto", { case: "mode", value: ToolChoiceMode.AUTO }],
      ["none", { case: "mode", value: ToolChoiceMode.NONE }],
      ["required", { case: "mode", value: ToolChoiceMode.REQUIRED }],
      [{ name: "get_time" }, { case: "name", value: "get_time" }],
    ];
    for (const [choice, want] of cases) assert.deepEqual(create(ToolChoiceSchema, toolChoice(choice)).choice, want);
    assert.throws(() => toolChoice("always" as "auto"), /unknown tool choice "always"/);
  });

  it("leaves unset options to the server", () => {
    assert.deepEqual(Object.keys(withTools([weather])), ["tools"]);
    assert.deepEqual(withTools([weather], { parallelToolCalls: false }).parallelToolCalls, false);
  });
});

describe("tool calls through a server", () => {
  let fake: Fake;
  let client: GengateClient;
  before(async () => {
    fake = await startFake();
    fake.toolArguments = { get_weather: '{"city":"Paris"}', get_time: '{"zone":"CET"}' };
    client = new GengateClient({ address: fake.url });
  });
  after(() => fake.close());

  it("sends tools, the choice and parallel calls, and returns the calls", async () => {
    const cases = [
      { options: {}, calls: ["get_weather", "get_time"] },
      { options: { choice: "required" as const, parallelToolCalls: false }, calls: ["get_weather"] },
      { options: { choice: { name: "get_time" } }, calls: ["get_time"] },
      { options: { choice: "none" as const }, calls: [] },
    ];
    for (const { options, calls } of cases) {
      const response = await client.generate(prompt("tiny", "weather and time?", withTools([weather, clock], options)));
      const sent = fake.requests.at(-1)!;
      assert.deepEqual(
        sent.tools.map((t) => [t.name, t.description, t.parametersJson]),
        [
          ["get_weather", "Current weather", weather.parametersJson],
          ["get_time", "", clock.parametersJson],
        ],
      );
      assert.deepEqual(sent.toolChoice?.choice, options.choice === undefined ? undefined : create(ToolChoiceSchema, toolChoice(options.choice)).choice);
      assert.equal(sent.parallelToolCalls, "parallelToolCalls" in options ? options.parallelToolCalls : undefined);
      const generation = response.generations[0]!;
      assert.deepEqual(generation.toolCalls.map((c) => c.name), calls);
      assert.equal(generation.finishReason, calls.length > 0 ? FinishReason.TOOL_CALLS : FinishReason.STOP);
    }
  });

  it("continues the conversation with the results", async () => {
    const question: ChatMessageInit[] = [{ role: Role.USER, content: [{ part: { case: "text", value: "weather and time in Paris?" } }] }];
    const request = (messages: ChatMessageInit[]) => ({ model: "tiny", input: { case: "messages" as const, value: { messages } }, ...withTools([weather, clock]) });
    const first = (await client.generate(request(question))).generations[0]!;
    const [w] = parseToolCalls(first, [weather, clock]);
    assert.ok(w?.name === "get_weather" && w.arguments.city === "Paris");
    const messages = withToolResults(question, first, { call_0: "sunny", call_1: "14:00" });
    assert.equal(question.length, 1, "the caller's messages are not changed");
    const answer = await client.generate(request(messages));
    const sent = fake.requests.at(-1)!;
    assert.equal(sent.input.case, "messages");
    const got = sent.input.value.messages;
    const want = [
      question[0]!,
      { role: Role.ASSISTANT, toolCalls: first.toolCalls },
      toolMessage("call_0", "sunny"),
      toolMessage("call_1", "14:00"),
    ].map((m) => create(ChatMessageSchema, m));
    assert.equal(got.length, want.length);
    for (const [i, m] of want.entries()) assert.ok(equals(ChatMessageSchema, got[i]!, m), `message ${i}: ${JSON.stringify(got[i])}`);
    assert.equal(got[2]!.role, Role.TOOL);
    assert.equal(got[2]!.toolCallId, "call_0");
    assert.equal(answer.generations[0]?.text, "call_0 get_weather=sunny; call_1 get_time=14:00");
  });

  it("keeps text and reasoning, and refuses results that do not match the calls", () => {
    const generation = create(GenerationSchema, {
      text: "Let me look.",
      toolCalls: [call("get_weather", '{"city":"Paris"}', "a")],
      reasoning: { text: "need the weather", signatures: ["sig"] },
    });
    const [assistant] = withToolResults([], generation, new Map([["a", "sunny"]])).map((m) => create(ChatMessageSchema, m));
    assert.equal(assistant?.content[0]?.part.value, "Let me look.");
    assert.deepEqual(assistant?.reasoning?.signatures, ["sig"]);
    assert.throws(() => withToolResults([], generation, {}), /no result for tool call a/);
    assert.throws(() => withToolResults([], generation, { a: "sunny", b: "rain" }), /a result for "b"/);
    assert.throws(() => withToolResults([], create(GenerationSchema, { text: "hi" }), {}), /made no tool call/);
  });

  it("a stream's fragments assemble into the end frame's calls", async () => {
    const collected = new StreamToolCalls();
    let fragments = 0;
    let finalBeforeEnd = false;
    for await (const frame of client.generateStream(prompt("tiny", "weather and time?", withTools([weather, clock])))) {
      if (frame.frame.case === "delta") {
        fragments += frame.frame.value.toolCalls.length;
        finalBeforeEnd ||= collected.final(0) !== undefined;
      }
      collected.add(frame);
    }
    assert.equal(fragments, 4);
    assert.equal(finalBeforeEnd, false);
    const final = collected.final(0)!;
    assert.deepEqual(
      final.map((c) => [c.id, c.name, c.argumentsJson]),
      [
        ["call_0", "get_weather", '{"city":"Paris"}'],
        ["call_1", "get_time", '{"zone":"CET"}'],
      ],
    );
    assert.deepEqual(collected.partial(0), final.map((c) => ({ id: c.id, name: c.name, argumentsJson: c.argumentsJson })));
    assert.equal(collected.final(1), undefined);
    assert.deepEqual(parseToolCalls(final, [weather, clock]).map((c) => c.arguments), [{ city: "Paris" }, { zone: "CET" }]);
  });
});
