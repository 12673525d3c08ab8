import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { create, equals } from "@bufbuild/protobuf";

import {
  ChatMessageSchema,
  GengateClient,
  MagpiePreset,
  MagpieSchema,
  Role,
  conversation,
  magpie,
  magpieInput,
  prompt,
  type Turn,
} from "../src/index.js";
import { startFake, type Fake } from "./fake.js";

const text = (value: string) => [{ part: { case: "text" as const, value } }];

describe("Magpie requests and conversations", () => {
  let fake: Fake;
  let client: GengateClient;
  before(async () => {
    fake = await startFake();
    client = new GengateClient({ address: fake.url });
  });
  after(() => fake.close());

  it("sends the typed Magpie input and decodes the conversation", async () => {
    const request = magpie(
      "tiny",
      {
        template: "qwen2",
        systemPrompt: "Ask about cooking.",
        conversation: [
          { role: "user", content: "Hi" },
          { role: Role.ASSISTANT, content: text("Hello") },
        ],
        nTurns: 2,
        endWithUser: true,
      },
      { sampling: { seed: 7n }, n: 2 },
    );
    const response = await client.generate(request);
    const sent = fake.requests.at(-1)!;
    assert.equal(sent.model, "tiny");
    assert.equal(sent.sampling?.seed, 7n);
    assert.equal(sent.n, 2);
    assert.equal(sent.input.case, "magpie");
    const want = create(MagpieSchema, {
      preQuery: { case: "preset", value: MagpiePreset.QWEN2 },
      systemPrompt: "Ask about cooking.",
      conversation: [
        { role: Role.USER, content: text("Hi") },
        { role: Role.ASSISTANT, content: text("Hello") },
      ],
      nTurns: 2,
      endWithUser: true,
    });
    assert.ok(equals(MagpieSchema, sent.input.value!, want), `sent ${JSON.stringify(sent.input.value)}`);
    const turns: Turn[] = [
      { role: "user", text: "Hi", outputTokens: 0 },
      { role: "assistant", text: "Hello", outputTokens: 0 },
      { role: "user", text: "question 1", outputTokens: 2 },
      { role: "assistant", text: "answer 1", outputTokens: 3 },
      { role: "user", text: "question 2", outputTokens: 2 },
    ];
    assert.equal(response.generations.length, 2);
    for (const generation of response.generations) assert.deepEqual(conversation(generation), turns);
  });

  it("goes in a batch, and other requests have no conversation", async () => {
    const items = [];
    for await (const item of client.batchGenerate([magpie("tiny", { template: "phi3", onlyInstruction: true }), prompt("tiny", "hi")])) {
      items[item.index] = item;
    }
    assert.deepEqual(conversation(items[0]?.response?.generations[0]), [{ role: "user", text: "question 1", outputTokens: 2 }]);
    assert.deepEqual(conversation(items[1]?.response?.generations[0]), []);
    assert.deepEqual(conversation(undefined), []);
    const sent = fake.requests.at(-2)!;
    assert.ok(sent.input.case === "magpie" && sent.input.value.preQuery.case === "preset");
    assert.equal(sent.input.value.preQuery.value, MagpiePreset.PHI3);
  });
});

describe("magpieInput", () => {
  it("maps each preset name to its preset", () => {
    const presets = { llama3: MagpiePreset.LLAMA3, qwen2: MagpiePreset.QWEN2, phi3: MagpiePreset.PHI3, gemma: MagpiePreset.GEMMA };
    for (const [name, preset] of Object.entries(presets)) {
      assert.deepEqual(magpieInput({ template: name }).preQuery, { case: "preset", value: preset });
    }
  });

  it("sends any other text as the template, as the Python client does", () => {
    for (const template of ["<|im_start|>user\n", "Qwen2", "llama-3", "toString", ""]) {
      assert.deepEqual(magpieInput({ template }).preQuery, { case: "template", value: template });
    }
  });

  it("leaves unset options to the server's defaults", () => {
    const m = create(MagpieSchema, magpieInput({ template: "gemma" }));
    assert.equal(m.systemPrompt, undefined);
    assert.equal(m.nTurns, undefined);
    assert.deepEqual(m.conversation, []);
    assert.equal(m.onlyInstruction, false);
    assert.equal(m.endWithUser, false);
    assert.equal(create(MagpieSchema, magpieInput({ template: "gemma", systemPrompt: "" })).systemPrompt, "");
  });

  it("takes ChatMessage objects as given turns and refuses an unknown role name", () => {
    const message = create(ChatMessageSchema, { role: Role.USER, content: text("Hi") });
    assert.equal(magpieInput({ template: "qwen2", conversation: [message] }).conversation?.[0], message);
    assert.throws(
      () => magpieInput({ template: "qwen2", conversation: [{ role: "bot" as "user", content: "Hi" }] }),
      /unknown role "bot"/,
    );
  });
});
