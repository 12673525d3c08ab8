import assert from "node:assert/strict";
import { after, before, beforeEach, describe, it } from "node:test";

import { Code, DEFAULT_RETRY_POLICY, GengateClient, GengateError, prompt, type ClientOptions } from "../src/index.js";
import { startFake, type Fake } from "./fake.js";

/** The fake's refusal with `code` (a GengateError whose reason is FAKE_REFUSED). */
const refused =
  (code: Code) =>
  (e: unknown): boolean =>
    e instanceof GengateError && e.code === code && e.reason === "FAKE_REFUSED";

async function collect<T>(items: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const item of items) out.push(item);
  return out;
}

describe("retries", () => {
  let fake: Fake;
  let client: GengateClient;
  const make = (options: Partial<ClientOptions> = {}): GengateClient => new GengateClient({ address: fake.url, ...options });
  before(async () => {
    fake = await startFake();
  });
  beforeEach(() => {
    fake.attempts = {};
    fake.attemptHeaders = {};
    client = make();
  });
  after(() => fake.close());

  it("retries RESOURCE_EXHAUSTED after the server's pushback", async () => {
    fake.failNext("Generate", { code: Code.ResourceExhausted, pushback: "0", calls: 1 });
    const resp = await client.generate(prompt("tiny", "again"));
    assert.equal(resp.generations[0]?.text, "echo: again");
    assert.equal(fake.attempts["Generate"], 2);
  });

  it("backs off without a pushback", async () => {
    fake.failNext("Generate", { code: Code.Unavailable, calls: 1 });
    await client.generate(prompt("tiny", "again"));
    assert.equal(fake.attempts["Generate"], 2);
  });

  it("gives up after maxRetries with the server's error", async () => {
    fake.failNext("Generate", { code: Code.ResourceExhausted, pushback: "0", calls: 10 });
    await assert.rejects(client.generate(prompt("tiny", "x")), refused(Code.ResourceExhausted));
    assert.equal(fake.attempts["Generate"], DEFAULT_RETRY_POLICY.maxRetries + 1);
  });

  it("makes one attempt with maxRetries 0", async () => {
    for (const options of [{ maxRetries: 0 }, { retry: { maxRetries: 0 } }]) {
      fake.attempts = {};
      fake.failNext("Generate", { code: Code.Unavailable, pushback: "0", calls: 1 });
      await assert.rejects(make(options).generate(prompt("tiny", "x")), refused(Code.Unavailable));
      assert.equal(fake.attempts["Generate"], 1, JSON.stringify(options));
    }
  });

  it("makes maxRetries + 1 attempts", async () => {
    fake.failNext("Generate", { code: Code.Unavailable, pushback: "0", calls: 10 });
    await assert.rejects(make({ maxRetries: 4 }).generate(prompt("tiny", "x")), refused(Code.Unavailable));
    assert.equal(fake.attempts["Generate"], 5);
  });

  it("does not retry a negative or unreadable pushback", async () => {
    for (const pushback of ["-1", "soon"]) {
      fake.attempts = {};
      fake.failNext("Generate", { code: Code.ResourceExhausted, pushback, calls: 1 });
      await assert.rejects(client.generate(prompt("tiny", "x")), refused(Code.ResourceExhausted));
      assert.equal(fake.attempts["Generate"], 1, pushback);
    }
  });

  it("retries only the policy's codes", async () => {
    fake.failNext("Generate", { code: Code.Internal, pushback: "0", calls: 1 });
    await assert.rejects(client.generate(prompt("tiny", "x")), refused(Code.Internal));
    assert.equal(fake.attempts["Generate"], 1);
    const internal = make({ retry: { retryableCodes: [Code.Internal] } });
    fake.failNext("Generate", { code: Code.Internal, pushback: "0", calls: 1 });
    await internal.generate(prompt("tiny", "x"));
    assert.equal(fake.attempts["Generate"], 3);
  });

  it("retries a stream before its first message", async () => {
    fake.failNext("GenerateStream", { code: Code.Unavailable, pushback: "0", calls: 1 });
    const frames = await collect(client.generateStream(prompt("tiny", "a b")));
    assert.deepEqual(
      frames.map((f) => f.frame.case),
      ["start", "delta", "delta", "end"],
    );
    assert.equal(fake.attempts["GenerateStream"], 2);
  });

  it("never retries a stream after its first message", async () => {
    fake.failNext("GenerateStream", { code: Code.Unavailable, pushback: "0", calls: 1, afterFirstMessage: true });
    const seen: string[] = [];
    await assert.rejects(async () => {
      for await (const frame of client.generateStream(prompt("tiny", "a b"))) seen.push(frame.frame.case ?? "");
    }, refused(Code.Unavailable));
    assert.deepEqual(seen, ["start"]);
    assert.equal(fake.attempts["GenerateStream"], 1);
  });

  it("retries a batch before its first item", async () => {
    fake.failNext("BatchGenerate", { code: Code.ResourceExhausted, pushback: "0", calls: 1 });
    const items = await collect(client.batchGenerate([prompt("tiny", "a"), prompt("tiny", "b")]));
    assert.equal(items.length, 2);
    assert.equal(fake.attempts["BatchGenerate"], 2);
  });

  it("never retries CreateBatchJob or UploadBatchJob", async () => {
    fake.failNext("CreateBatchJob", { code: Code.Unavailable, pushback: "0", calls: 1 });
    fake.failNext("UploadBatchJob", { code: Code.Unavailable, pushback: "0", calls: 1 });
    await assert.rejects(client.batchJobs.create([prompt("tiny", "a")]), refused(Code.Unavailable));
    assert.equal(fake.attempts["CreateBatchJob"], 1);
    await assert.rejects(client.batchJobs.create([prompt("tiny", "a")], { defaults: { model: "tiny" } }), refused(Code.Unavailable));
    assert.equal(fake.attempts["UploadBatchJob"], 1);
  });

  it("retries the idempotent batch job calls", async () => {
    const job = await client.batchJobs.create([prompt("tiny", "a"), prompt("tiny", "pending")]);
    const methods = ["GetBatchJob", "ListBatchJobs", "CancelBatchJob", "StreamBatchJobResults"];
    for (const method of methods) fake.failNext(method, { code: Code.Unavailable, pushback: "0", calls: 1 });
    await client.batchJobs.get(job.id);
    await collect(client.batchJobs.list());
    await client.batchJobs.cancel(job.id);
    assert.equal((await collect(client.batchJobs.results(job.id, { follow: false }))).length, 2);
    assert.deepEqual(
      methods.map((m) => fake.attempts[m]),
      [2, 2, 2, 2],
    );
  });

  it("sends each retry the deadline left", async () => {
    fake.failNext("Generate", { code: Code.Unavailable, pushback: "0", calls: 1 });
    await client.generate(prompt("tiny", "x"), { timeoutMs: 60_000 });
    const timeouts = (fake.attemptHeaders["Generate"] ?? []).map((h) => h.get("grpc-timeout"));
    assert.equal(timeouts.length, 2);
    assert.equal(timeouts[0], "60000m");
    assert.match(timeouts[1] ?? "", /^\d+m$/);
    assert.ok(Number.parseInt(timeouts[1]!, 10) <= 60_000, `${timeouts[1]}`);
  });

  it("does not wait past the deadline: the error comes back as it was", async () => {
    fake.failNext("Generate", { code: Code.Unavailable, pushback: "60000", calls: 1 });
    await assert.rejects(client.generate(prompt("tiny", "x"), { timeoutMs: 5_000 }), refused(Code.Unavailable));
    assert.equal(fake.attempts["Generate"], 1);
  });

  it("does not retry an aborted call", async () => {
    fake.failNext("Generate", { code: Code.Unavailable, pushback: "60000", calls: 1 });
    const controller = new AbortController();
    const call = client.generate(prompt("tiny", "x"), { signal: controller.signal });
    // abort while it waits out the pushback (or, at worst, while the first attempt is in flight)
    while (fake.attempts["Generate"] !== 1) await new Promise((resolve) => setImmediate(resolve));
    controller.abort();
    await assert.rejects(call, (e: unknown) => e instanceof GengateError && e.code === Code.Canceled);
    assert.equal(fake.attempts["Generate"], 1);
  });

  it("refuses a policy gRPC would not take", () => {
    for (const options of [{ maxRetries: 5 }, { maxRetries: -1 }, { maxRetries: 1.5 }, { retry: { maxRetries: 9 } }, { retry: { initialBackoffMs: -1 } }]) {
      assert.throws(() => make(options), RangeError, JSON.stringify(options));
    }
  });
});
