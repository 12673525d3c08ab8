/**
 * An in-process GenerationService and BatchJobService (connect-node over HTTP/2) that records
 * what it receives.
 */
import * as http2 from "node:http2";
import type { AddressInfo } from "node:net";

import { clone, create, fromJsonString, mergeFromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter, type HandlerContext, type Interceptor } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import {
  GenerateRequestSchema,
  GenerateResponseSchema,
  GenerationService,
  type GenerateRequest,
  type GenerateStreamResponse,
} from "../src/gen/gengate/v1/generation_pb.js";
import {
  BatchJobSchema,
  BatchJobService,
  BatchJobState,
  type BatchJob,
  type BatchJobHeader,
  type CreateBatchJobRequest,
  type ListBatchJobsRequest,
  type StreamBatchJobResultsRequest,
  type StreamBatchJobResultsResponse,
} from "../src/gen/gengate/v1/jobs_pb.js";
import { BadRequestSchema, ErrorInfoSchema, RetryInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import {
  FinishReason,
  Role,
  ToolChoiceMode,
  type ConversationTurnSchema,
  type Magpie,
  type ToolCallSchema,
} from "../src/gen/gengate/v1/types_pb.js";
import { StatusSchema, type Status } from "../src/gen/google/rpc/status_pb.js";
import { anyPack } from "@bufbuild/protobuf/wkt";

/**
 * The conversation a Magpie request gets from the fake: the given turns (0 tokens), then
 * "question k" (2 tokens) and "answer k" (3 tokens) for each of nTurns (default 1), as
 * onlyInstruction and endWithUser say.
 */
function magpieTurns(m: Magpie): MessageInitShape<typeof ConversationTurnSchema>[] {
  const turns: MessageInitShape<typeof ConversationTurnSchema>[] = m.conversation.map((given) => ({
    role: given.role,
    text: given.content[0]?.part.case === "text" ? given.content[0].part.value : "",
  }));
  const n = m.onlyInstruction ? 1 : (m.nTurns ?? 1);
  for (let k = 1; k <= n; k++) {
    turns.push({ role: Role.USER, text: `question ${k}`, outputTokens: 2 });
    if (m.onlyInstruction || (m.endWithUser && k === n)) break;
    turns.push({ role: Role.ASSISTANT, text: `answer ${k}`, outputTokens: 3 });
  }
  return turns;
}

export interface Fake {
  url: string;
  headers: Headers[];
  requests: GenerateRequest[];
  /** Resolves when the server saw an "endless" stream cancelled. */
  cancelled: Promise<void>;
  /** Resolves when the server saw a "slow" unary call end (deadline passed or caller gone); the slow call never answers on its own. */
  slowEnded: Promise<void>;
  jsonText: string;
  /** The finish reason a json_schema request's generations end with (STOP unless set). */
  jsonFinish?: FinishReason;
  /** The arguments JSON of a call to each tool by name ("{}" when unset). */
  toolArguments: Record<string, string>;
  jobs: FakeJobs;
  /** Calls received by method ("Generate", "GetBatchJob", ...), refused ones too. */
  attempts: Record<string, number>;
  /** The request headers of each call received, by method, refused ones too. */
  attemptHeaders: Record<string, Headers[]>;
  /** Makes the next `fault.calls` calls of `method` fail as `fault` says. */
  failNext(method: string, fault: Fault): void;
  close(): Promise<void>;
}

/** A refusal the fake answers before a method's own rules. */
export interface Fault {
  code: Code;
  /** The grpc-retry-pushback-ms trailer sent with the error; unset: none. */
  pushback?: string;
  /** How many calls fail; later ones are answered by the method's rules again. */
  calls: number;
  /** A server stream fails after its first message instead of before any. */
  afterFirstMessage?: boolean;
}

/**
 * The in-memory BatchJobService. A job's items are answered when it is created (by the
 * Generate rules), except items whose prompt is "pending": they stay unfinished, and the job
 * RUNNING, until the job is cancelled.
 */
export interface FakeJobs {
  /** Each RPC received ("createBatchJob", "uploadBatchJob", ...), in order. */
  calls: string[];
  /** What the last calls carried. */
  last: {
    headers?: Headers;
    create?: CreateBatchJobRequest;
    header?: BatchJobHeader;
    list?: ListBatchJobsRequest;
    results?: StreamBatchJobResultsRequest;
  };
  /** How each upload ended: "stored"; "refused" (a message after the header that is no item);
   * "aborted" (the caller went away before the end). */
  uploads: string[];
  /** Resolves once `count` uploads have ended. */
  uploadsEnded(count: number): Promise<void>;
}

interface StoredJob {
  job: BatchJob;
  /** undefined: not finished. */
  results: (StreamBatchJobResultsResponse | undefined)[];
}

function check(req: GenerateRequest): ConnectError | undefined {
  if (req.model !== "tiny") {
    return new ConnectError(`unknown model ${req.model}`, Code.NotFound, undefined, [
      { desc: ErrorInfoSchema, value: { reason: "MODEL_NOT_FOUND", domain: "gengate.dev" } },
    ]);
  }
  const so = req.structuredOutput?.kind;
  if (so?.case === "regex" && so.value.pattern.split("(").length !== so.value.pattern.split(")").length) {
    return new ConnectError("invalid regex", Code.InvalidArgument, undefined, [
      {
        desc: BadRequestSchema,
        value: { fieldViolations: [{ field: "structured_output.regex.pattern", description: "unbalanced parenthesis" }] },
      },
    ]);
  }
  return undefined;
}

/** A ConnectError as the google.rpc.Status a batch item carries. */
function statusOf(err: ConnectError): Status {
  const details = err.details.map((d) => ("desc" in d ? anyPack(d.desc, create(d.desc, d.value)) : undefined)).filter((d) => d !== undefined);
  return create(StatusSchema, { code: err.code, message: err.rawMessage, details });
}

const jobError = (code: Code, reason: string, message: string): ConnectError =>
  new ConnectError(message, code, undefined, [{ desc: ErrorInfoSchema, value: { reason, domain: "gengate.dev" } }]);

const FINISHED = [BatchJobState.SUCCEEDED, BatchJobState.FAILED, BatchJobState.CANCELLED];

const sleep = (ms: number, signal?: AbortSignal): Promise<void> =>
  new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(t);
      reject(signal.reason);
    });
  });

/** Settles when the call's signal aborts, and never otherwise. */
const untilAborted = (signal: AbortSignal): Promise<never> =>
  new Promise((_, reject) => {
    if (signal.aborted) reject(signal.reason);
    else signal.addEventListener("abort", () => reject(signal.reason), { once: true });
  });

export async function startFake(options: http2.SecureServerOptions | undefined = undefined): Promise<Fake> {
  let markCancelled!: () => void;
  let markSlowEnded!: () => void;
  const fake: Fake = {
    url: "",
    headers: [],
    requests: [],
    cancelled: new Promise((resolve) => (markCancelled = resolve)),
    slowEnded: new Promise((resolve) => (markSlowEnded = resolve)),
    jsonText: '{"name":"Ada","age":36}',
    toolArguments: {},
    jobs: { calls: [], last: {}, uploads: [], uploadsEnded: () => Promise.resolve() },
    attempts: {},
    attemptHeaders: {},
    failNext: (method, fault) => void faults.set(method, { ...fault }),
    close: async () => {},
  };
  const faults = new Map<string, Fault>();
  // Counts every call and answers the faults, with RetryInfo as the real server sends it.
  const faulty: Interceptor = (next) => async (req) => {
    const method = req.method.name;
    fake.attempts[method] = (fake.attempts[method] ?? 0) + 1;
    (fake.attemptHeaders[method] ??= []).push(new Headers(req.header));
    const fault = faults.get(method);
    if (!fault || fault.calls === 0) return next(req);
    fault.calls--;
    const refusal = new ConnectError(
      "fake refusal",
      fault.code,
      fault.pushback === undefined ? undefined : { "grpc-retry-pushback-ms": fault.pushback },
      [
        { desc: ErrorInfoSchema, value: { reason: "FAKE_REFUSED", domain: "gengate.dev" } },
        { desc: RetryInfoSchema, value: { retryDelay: { seconds: 0n } } },
      ],
    );
    if (!fault.afterFirstMessage) throw refusal;
    const res = await next(req);
    if (!res.stream) throw refusal;
    const messages = res.message;
    return {
      ...res,
      message: (async function* () {
        let sent = 0;
        for await (const m of messages) {
          if (sent++ > 0) throw refusal;
          yield m;
        }
      })(),
    };
  };
  const stored: StoredJob[] = [];
  // Resolved (and replaced) whenever a job changes, waking following streams.
  let changed!: () => void;
  let change = new Promise<void>((resolve) => (changed = resolve));
  const notify = (): void => {
    const wake = changed;
    change = new Promise<void>((resolve) => (changed = resolve));
    wake();
  };
  const uploadWaiters: { count: number; resolve: () => void }[] = [];
  fake.jobs.uploadsEnded = (count) =>
    fake.jobs.uploads.length >= count ? Promise.resolve() : new Promise((resolve) => uploadWaiters.push({ count, resolve }));
  const uploadEnded = (outcome: string): void => {
    fake.jobs.uploads.push(outcome);
    for (const w of uploadWaiters.filter((w) => fake.jobs.uploads.length >= w.count)) {
      uploadWaiters.splice(uploadWaiters.indexOf(w), 1);
      w.resolve();
    }
  };
  const called = (name: string, ctx: HandlerContext): void => {
    fake.jobs.calls.push(name);
    fake.jobs.last.headers = new Headers(ctx.requestHeader);
  };
  const find = (id: string): StoredJob => {
    const found = stored.find((s) => s.job.id === id);
    if (!found) throw jobError(Code.NotFound, "JOB_NOT_FOUND", `no batch job ${JSON.stringify(id)}`);
    return found;
  };
  /** Stores a job of items (an error stands for an item refused with it). */
  const store = (header: Pick<BatchJobHeader, "displayName" | "idempotencyKey" | "options">, items: (GenerateRequest | ConnectError)[]): BatchJob => {
    const job = create(BatchJobSchema, {
      id: `job-${(stored.length + 1).toString(16).padStart(24, "0")}`,
      displayName: header.displayName,
      idempotencyKey: header.idempotencyKey,
      options: header.options,
      total: BigInt(items.length),
      state: BatchJobState.SUCCEEDED,
    });
    const results = items.map((item, i): StreamBatchJobResultsResponse | undefined => {
      const index = BigInt(i);
      if (!(item instanceof ConnectError) && item.input.case === "prompt" && item.input.value === "pending") {
        job.state = BatchJobState.RUNNING;
        return undefined;
      }
      job.done++;
      const err = item instanceof ConnectError ? item : check(item);
      if (err) {
        job.failed++;
        return { index, result: { case: "error", value: statusOf(err) } } as StreamBatchJobResultsResponse;
      }
      return { index, result: { case: "response", value: answer(item as GenerateRequest) } } as StreamBatchJobResultsResponse;
    });
    stored.push({ job, results });
    notify();
    return clone(BatchJobSchema, job);
  };
  const record = (req: GenerateRequest | undefined, ctx: HandlerContext): void => {
    fake.headers.push(new Headers(ctx.requestHeader));
    if (req) fake.requests.push(req);
  };
  /**
   * How the fake answers a request with tools: a call to each offered tool ("call_<i>",
   * toolArguments), only the named one under a named choice, the first only when parallel calls
   * are off, none under NONE or after a tool result.
   */
  const toolCalls = (req: GenerateRequest): MessageInitShape<typeof ToolCallSchema>[] => {
    const messages = req.input.case === "messages" ? req.input.value.messages : [];
    const choice = req.toolChoice?.choice;
    if (req.tools.length === 0 || messages.at(-1)?.role === Role.TOOL || (choice?.case === "mode" && choice.value === ToolChoiceMode.NONE)) return [];
    const calls: MessageInitShape<typeof ToolCallSchema>[] = [];
    for (const t of req.tools) {
      if (choice?.case === "name" && choice.value !== t.name) continue;
      calls.push({ id: `call_${calls.length}`, name: t.name, argumentsJson: fake.toolArguments[t.name] ?? "{}" });
      if (req.parallelToolCalls === false) break;
    }
    return calls;
  };
  /** The fake's answer after tool results: "<call id> <tool name>=<result>" each, "; "-joined. */
  const toolResults = (req: GenerateRequest): string | undefined => {
    const messages = req.input.case === "messages" ? req.input.value.messages : [];
    if (messages.at(-1)?.role !== Role.TOOL) return undefined;
    const names = new Map(messages.flatMap((m) => m.toolCalls.map((c) => [c.id, c.name] as const)));
    return messages
      .filter((m) => m.role === Role.TOOL)
      .map((m) => `${m.toolCallId} ${names.get(m.toolCallId)}=${m.content[0]?.part.case === "text" ? m.content[0].part.value : ""}`)
      .join("; ");
  };
  const answer = (req: GenerateRequest) => {
    const calls = toolCalls(req);
    const text =
      calls.length > 0
        ? ""
        : (toolResults(req) ?? (req.structuredOutput?.kind.case === "jsonSchema" ? fake.jsonText : `echo: ${req.input.case === "prompt" ? req.input.value : ""}`));
    const n = req.n ?? 1;
    const turns = req.input.case === "magpie" ? magpieTurns(req.input.value) : [];
    return create(GenerateResponseSchema, {
      model: req.model,
      requestId: req.requestId,
      generations: Array.from({ length: n }, (_, index) => ({
        index,
        text: turns.at(-1)?.text ?? text,
        outputTokens: 3,
        finishReason:
          calls.length > 0
            ? FinishReason.TOOL_CALLS
            : req.structuredOutput?.kind.case === "jsonSchema"
              ? (fake.jsonFinish ?? FinishReason.STOP)
              : FinishReason.STOP,
        conversation: turns,
        toolCalls: calls,
      })),
    });
  };
  const routes = (router: ConnectRouter): void => {
    router.service(BatchJobService, {
      async createBatchJob(req, ctx) {
        called("createBatchJob", ctx);
        fake.jobs.last.create = req;
        if (req.requests.length === 0) throw new ConnectError("requests must contain at least one request", Code.InvalidArgument);
        return { job: store(req, req.requests) };
      },
      async uploadBatchJob(messages, ctx) {
        called("uploadBatchJob", ctx);
        const items: (GenerateRequest | ConnectError)[] = [];
        let header: BatchJobHeader | undefined;
        try {
          for await (const message of messages) {
            const part = message.part;
            if (!header) {
              if (part.case !== "header") throw new ConnectError("the first message of an upload must be the header", Code.InvalidArgument);
              header = fake.jobs.last.header = part.value;
              continue;
            }
            let item: GenerateRequest | ConnectError;
            if (part.case === "request") {
              item = part.value;
            } else if (part.case === "jsonLine") {
              try {
                item = fromJsonString(GenerateRequestSchema, part.value);
              } catch (e) {
                item = new ConnectError(`requests[${items.length}] is not a JSON request: ${String(e)}`, Code.InvalidArgument);
              }
            } else {
              uploadEnded("refused");
              throw new ConnectError("only the first message is a header", Code.InvalidArgument);
            }
            if (header.defaults && !(item instanceof ConnectError)) {
              item = mergeFromBinary(GenerateRequestSchema, clone(GenerateRequestSchema, header.defaults), toBinary(GenerateRequestSchema, item));
            }
            items.push(item);
          }
        } catch (e) {
          if (ctx.signal.aborted) uploadEnded("aborted"); // the caller went away before the end: no job
          throw e;
        }
        if (!header) throw new ConnectError("an upload must start with the header", Code.InvalidArgument);
        const job = store(header, items);
        uploadEnded("stored");
        return { job };
      },
      async getBatchJob(req, ctx) {
        called("getBatchJob", ctx);
        return { job: clone(BatchJobSchema, find(req.id).job) };
      },
      async listBatchJobs(req, ctx) {
        called("listBatchJobs", ctx);
        fake.jobs.last.list = req;
        const size = req.pageSize || 50;
        const start = req.pageToken ? Number(req.pageToken) : 0;
        const newest = [...stored].reverse();
        return {
          jobs: newest.slice(start, start + size).map((s) => clone(BatchJobSchema, s.job)),
          nextPageToken: start + size < newest.length ? String(start + size) : "",
        };
      },
      async cancelBatchJob(req, ctx) {
        called("cancelBatchJob", ctx);
        const found = find(req.id);
        if (FINISHED.includes(found.job.state)) {
          throw jobError(Code.FailedPrecondition, "JOB_FINISHED", `batch job ${found.job.id} has already ended`);
        }
        const cancelled = statusOf(jobError(Code.Canceled, "JOB_CANCELLED", "the batch job was cancelled before this item finished"));
        found.results = found.results.map((r, i) => {
          if (r) return r;
          found.job.done++;
          found.job.failed++;
          return { index: BigInt(i), result: { case: "error", value: cancelled } } as StreamBatchJobResultsResponse;
        });
        found.job.state = BatchJobState.CANCELLED;
        notify();
        return { job: clone(BatchJobSchema, found.job) };
      },
      async *streamBatchJobResults(req, ctx) {
        called("streamBatchJobResults", ctx);
        fake.jobs.last.results = req;
        let next = req.afterIndex === undefined ? 0 : Number(req.afterIndex) + 1;
        for (;;) {
          const found = find(req.id);
          const wait = change;
          for (let r = found.results[next]; r !== undefined; r = found.results[++next]) yield r;
          if (next >= found.results.length || !req.follow) return;
          await Promise.race([wait, untilAborted(ctx.signal)]);
        }
      },
    });
    router.service(GenerationService, {
      async generate(req, ctx) {
        record(req, ctx);
        if (req.input.case === "prompt" && req.input.value === "slow") {
          // Only the deadline or the caller's cancel ends it.
          try {
            await untilAborted(ctx.signal);
          } finally {
            markSlowEnded();
          }
        }
        const err = check(req);
        if (err) throw err;
        return answer(req);
      },
      async *generateStream(wrapper, ctx) {
        const req = wrapper.request!;
        record(req, ctx);
        const err = check(req);
        if (err) throw err;
        const text = req.input.case === "prompt" ? req.input.value : "";
        yield { frame: { case: "start", value: { model: req.model, requestId: "r1" } } } as GenerateStreamResponse;
        const calls = toolCalls(req);
        if (calls.length > 0) {
          // Each call in two fragments (id and name on the first), then the end frame with the calls.
          for (const [index, call] of calls.entries()) {
            const args = call.argumentsJson ?? "";
            const half = Math.floor(args.length / 2);
            for (const fragment of [
              { index, id: call.id, name: call.name, argumentsFragment: args.slice(0, half) },
              { index, argumentsFragment: args.slice(half) },
            ]) {
              yield { frame: { case: "delta", value: { tokenCount: 1, toolCalls: [fragment] } } } as GenerateStreamResponse;
            }
          }
          yield { frame: { case: "end", value: { finishReason: FinishReason.TOOL_CALLS, toolCalls: calls } } } as GenerateStreamResponse;
          return;
        }
        const endless = text === "endless"; // deltas until the call ends, however long that takes
        const words = endless ? [] : text.split(" ");
        try {
          for (let i = 0; endless || i < words.length; i++) {
            await sleep(2, ctx.signal);
            yield { frame: { case: "delta", value: { text: `${endless ? "x" : words[i]} `, tokenCount: 1 } } } as GenerateStreamResponse;
          }
        } catch (e) {
          if (ctx.signal.aborted) markCancelled();
          throw e;
        }
        yield { frame: { case: "end", value: { finishReason: FinishReason.STOP, usage: { outputTokens: words.length } } } } as GenerateStreamResponse;
      },
      async *batchGenerate(req, ctx) {
        for (const [index, item] of req.requests.entries()) {
          record(item, ctx);
          const err = check(item);
          if (err) {
            yield { index, result: { case: "error", value: statusOf(err) } };
          } else {
            yield { index, result: { case: "response", value: answer(item) } };
          }
        }
      },
      async listModels(_req, ctx) {
        record(undefined, ctx);
        return { models: [{ name: "tiny", backend: "fake", capabilities: { maxN: 4, seed: true } }] };
      },
    });
  };
  const handler = connectNodeAdapter({ routes, interceptors: [faulty] });
  const server = options ? http2.createSecureServer(options, handler) : http2.createServer(handler);
  const sessions = new Set<http2.Http2Session>();
  server.on("session", (s: http2.Http2Session) => {
    sessions.add(s);
    s.on("close", () => sessions.delete(s));
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as AddressInfo).port;
  fake.url = `127.0.0.1:${port}`;
  fake.close = () =>
    new Promise((resolve) => {
      server.close(() => resolve());
      for (const s of sessions) s.destroy();
    });
  return fake;
}
