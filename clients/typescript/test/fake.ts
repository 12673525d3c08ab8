/** An in-process GenerationService (connect-node over HTTP/2) that records what it receives. */
import * as http2 from "node:http2";
import type { AddressInfo } from "node:net";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter, type HandlerContext } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import {
  GenerateResponseSchema,
  GenerationService,
  type GenerateRequest,
  type GenerateStreamResponse,
} from "../src/gen/gengate/v1/generation_pb.js";
import { BadRequestSchema, ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { FinishReason } from "../src/gen/gengate/v1/types_pb.js";
import { StatusSchema } from "../src/gen/google/rpc/status_pb.js";
import { anyPack } from "@bufbuild/protobuf/wkt";

export interface Fake {
  url: string;
  headers: Headers[];
  requests: GenerateRequest[];
  /** Resolves when the server saw an "endless" stream cancelled. */
  cancelled: Promise<void>;
  /** Resolves when the server saw a "slow" unary call end (deadline passed or caller gone); the slow call never answers on its own. */
  slowEnded: Promise<void>;
  jsonText: string;
  close(): Promise<void>;
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
    close: async () => {},
  };
  const record = (req: GenerateRequest | undefined, ctx: HandlerContext): void => {
    fake.headers.push(new Headers(ctx.requestHeader));
    if (req) fake.requests.push(req);
  };
  const answer = (req: GenerateRequest) => {
    const text = req.structuredOutput?.kind.case === "jsonSchema" ? fake.jsonText : `echo: ${req.input.case === "prompt" ? req.input.value : ""}`;
    const n = req.n ?? 1;
    return create(GenerateResponseSchema, {
      model: req.model,
      requestId: req.requestId,
      generations: Array.from({ length: n }, (_, index) => ({ index, text, finishReason: FinishReason.STOP })),
    });
  };
  const routes = (router: ConnectRouter): void => {
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
            const details = err.details.map((d) => ("desc" in d ? anyPack(d.desc, create(d.desc, d.value)) : undefined)).filter((d) => d !== undefined);
            yield { index, result: { case: "error", value: create(StatusSchema, { code: err.code, message: err.rawMessage, details }) } };
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
  const handler = connectNodeAdapter({ routes });
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
