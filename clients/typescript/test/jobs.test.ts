import assert from "node:assert/strict";
import { afterEach, beforeEach, describe, it } from "node:test";

import {
  BatchJobState,
  Code,
  GengateClient,
  GengateError,
  UPLOAD_ABOVE,
  prompt,
  regex,
  type BatchItem,
  type GenerateRequestInit,
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

async function collect(items: AsyncIterable<BatchItem>): Promise<BatchItem[]> {
  const out: BatchItem[] = [];
  for await (const item of items) out.push(item);
  return out;
}

const jobRequests = (): GenerateRequestInit[] => [
  prompt("tiny", "one"),
  prompt("nope", "two"),
  prompt("tiny", "three"),
  prompt("tiny", "four", { structuredOutput: regex("(ab") }),
];

const isError = (code: Code, reason: string) => (e: unknown) => {
  assert.ok(e instanceof GengateError, String(e));
  assert.equal(e.code, code);
  assert.equal(e.reason, reason);
  return true;
};

describe("client.batchJobs against an in-process fake server", () => {
  let fake: Fake;
  let client: GengateClient;
  beforeEach(async () => {
    fake = await startFake();
    client = new GengateClient({ address: fake.url, token: "s3cret" });
  });
  afterEach(() => fake.close());

  it("creates a job and reads its results in index order, a failed item as a GengateError", async () => {
    const job = await client.batchJobs.create(jobRequests(), {
      displayName: "nightly",
      idempotencyKey: "k1",
      priority: 3,
      maxConcurrency: 2,
      offline: true,
      metadata: { "x-call": "1" },
    });
    assert.match(job.id, /^job-/);
    assert.equal(job.total, 4n);
    assert.equal(job.displayName, "nightly");
    assert.deepEqual(fake.jobs.calls, ["createBatchJob"]);
    const sent = fake.jobs.last.create!;
    assert.equal(sent.requests.length, 4);
    assert.equal(sent.idempotencyKey, "k1");
    assert.deepEqual([sent.options?.priority, sent.options?.maxConcurrency, sent.options?.offline], [3, 2, true]);
    assert.equal(fake.jobs.last.headers?.get("authorization"), "Bearer s3cret");
    assert.equal(fake.jobs.last.headers?.get("x-call"), "1");

    const items = await collect(client.batchJobs.results(job.id, { follow: false }));
    assert.deepEqual(items.map((i) => i.index), [0, 1, 2, 3]);
    assert.equal(fake.jobs.last.results?.afterIndex, undefined, "after_index must be unset");
    assert.equal(items[0]?.response?.generations[0]?.text, "echo: one");
    assert.equal(items[2]?.error, undefined);
    const bad = items[1]?.error;
    assert.ok(bad instanceof GengateError);
    assert.equal(bad.code, Code.NotFound);
    assert.equal(bad.reason, "MODEL_NOT_FOUND");
    assert.equal(items[1]?.response, undefined);
    assert.equal(items[3]?.error?.code, Code.InvalidArgument);
    assert.equal(items[3]?.error?.field("structured_output.regex.pattern")?.description, "unbalanced parenthesis");

    const got = await client.batchJobs.get(job.id);
    assert.equal(got.state, BatchJobState.SUCCEEDED);
    assert.deepEqual([got.done, got.failed], [4n, 2n]);
  });

  it("resumes the results after an index", async () => {
    const job = await client.batchJobs.create(jobRequests());
    const items = await collect(client.batchJobs.results(job.id, { afterIndex: 1 }));
    assert.deepEqual(items.map((i) => i.index), [2, 3]);
    assert.equal(items[0]?.response?.generations[0]?.text, "echo: three");
    assert.equal(fake.jobs.last.results?.afterIndex, 1n);
    assert.equal(fake.jobs.last.results?.follow, true, "follow is the default");
    assert.deepEqual(await collect(client.batchJobs.results(job.id, { afterIndex: 3n })), []);
  });

  it("follows a running job until its last item, which a cancel finishes", async () => {
    const job = await client.batchJobs.create([prompt("tiny", "one"), prompt("tiny", "pending")]);
    assert.equal(job.state, BatchJobState.RUNNING);
    // Without follow the stream ends at the first unfinished item.
    assert.deepEqual((await collect(client.batchJobs.results(job.id, { follow: false }))).map((i) => i.index), [0]);
    const items: BatchItem[] = [];
    for await (const item of client.batchJobs.results(job.id)) {
      items.push(item);
      if (item.index === 0) {
        const cancelled = await client.batchJobs.cancel(job.id);
        assert.equal(cancelled.state, BatchJobState.CANCELLED);
      }
    }
    assert.deepEqual(items.map((i) => i.index), [0, 1]);
    assert.equal(items[1]?.error?.code, Code.Canceled);
    assert.equal(items[1]?.error?.reason, "JOB_CANCELLED");
  });

  it("cancels the results stream when the loop is left early", async () => {
    const job = await client.batchJobs.create([prompt("tiny", "one"), prompt("tiny", "pending")]);
    for await (const item of client.batchJobs.results(job.id)) {
      assert.equal(item.index, 0);
      break; // the stream would otherwise wait for item 1 forever
    }
  });

  it("reports unknown ids and cancelling a finished job as GengateErrors", async () => {
    const job = await client.batchJobs.create([prompt("tiny", "one")]);
    await assert.rejects(client.batchJobs.cancel(job.id), isError(Code.FailedPrecondition, "JOB_FINISHED"));
    await assert.rejects(client.batchJobs.cancel("job-nope"), isError(Code.NotFound, "JOB_NOT_FOUND"));
    await assert.rejects(client.batchJobs.get("job-nope"), isError(Code.NotFound, "JOB_NOT_FOUND"));
    await assert.rejects(collect(client.batchJobs.results("job-nope")), isError(Code.NotFound, "JOB_NOT_FOUND"));
    await assert.rejects(client.batchJobs.create([]), (e: unknown) => e instanceof GengateError && e.code === Code.InvalidArgument);
  });

  it("lists every job newest first, a page at a time", async () => {
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) ids.unshift((await client.batchJobs.create([prompt("tiny", "x")])).id);
    const listed: string[] = [];
    for await (const job of client.batchJobs.list({ pageSize: 2 })) listed.push(job.id);
    assert.deepEqual(listed, ids);
    const pages = () => fake.jobs.calls.filter((c) => c === "listBatchJobs").length;
    assert.equal(pages(), 3);
    assert.equal(fake.jobs.last.list?.pageSize, 2);
    for await (const job of client.batchJobs.list({ pageSize: 2, token: "t" })) {
      assert.equal(job.id, ids[0]);
      break; // leaving the loop fetches no further page
    }
    assert.equal(pages(), 4);
    assert.equal(fake.jobs.last.headers?.get("authorization"), "Bearer t");
  });

  it(`uploads a job of more than ${UPLOAD_ABOVE} requests`, async () => {
    const requests = Array.from({ length: UPLOAD_ABOVE + 1 }, (_, i) => prompt("tiny", i === UPLOAD_ABOVE ? "last" : "item"));
    await client.batchJobs.create(requests.slice(0, UPLOAD_ABOVE));
    assert.deepEqual(fake.jobs.calls, ["createBatchJob"]);
    const job = await client.batchJobs.create(requests, { displayName: "big", priority: 1 });
    assert.deepEqual(fake.jobs.calls, ["createBatchJob", "uploadBatchJob"]);
    assert.equal(job.total, BigInt(requests.length));
    assert.equal(fake.jobs.last.header?.displayName, "big");
    assert.equal(fake.jobs.last.header?.options?.priority, 1);
    assert.equal(fake.jobs.last.header?.defaults, undefined);
    const items = await collect(client.batchJobs.results(job.id, { afterIndex: UPLOAD_ABOVE - 1 }));
    assert.deepEqual(items.map((i) => i.index), [UPLOAD_ABOVE]);
    assert.equal(items[0]?.response?.generations[0]?.text, "echo: last");
  });

  it("uploads item defaults and JSONL lines", async () => {
    const defaults = { model: "tiny" };
    const job = await client.batchJobs.create([{ input: { case: "prompt", value: "a" } }], { defaults });
    assert.deepEqual(fake.jobs.calls, ["uploadBatchJob"]);
    assert.equal(fake.jobs.last.header?.defaults?.model, "tiny");
    const [first] = await collect(client.batchJobs.results(job.id));
    assert.equal(first?.response?.generations[0]?.text, "echo: a");

    const text = '{"prompt": "a"}\r\n\n   \n{not json\n{"prompt": "c"}';
    for (const lines of [text, text.split("\n")]) {
      const fromJsonl = await client.batchJobs.createFromJsonl(lines, { defaults });
      assert.equal(fromJsonl.total, 3n);
      const items = await collect(client.batchJobs.results(fromJsonl.id));
      assert.equal(items[0]?.error, undefined);
      assert.equal(items[1]?.error?.code, Code.InvalidArgument);
      assert.equal(items[2]?.response?.generations[0]?.text, "echo: c");
    }
    assert.deepEqual(fake.jobs.uploads, ["stored", "stored", "stored"]);
  });

  it("abandons an upload whose lines' source throws, so the server runs none of it", async () => {
    const broken = new Error("disk gone");
    async function* lines(): AsyncGenerator<string> {
      yield '{"prompt": "a"}';
      throw broken;
    }
    await assert.rejects(client.batchJobs.createFromJsonl(lines(), { defaults: { model: "tiny" } }), (e: unknown) => e === broken);
    // The server refused the upload before any end of its stream: the fake stores no job.
    await observed(fake.jobs.uploadsEnded(1), "the server never saw the abandoned upload end");
    assert.deepEqual(fake.jobs.uploads, ["refused"]);
    for await (const job of client.batchJobs.list()) assert.fail(`job ${job.id} stored`);
  });
});
