/** GengateClient: the typed wrapper over the generated GenerationService client. */
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client as ConnectClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import type { z } from "zod";

import { GengateError } from "./errors.js";
import { BatchJobService } from "./gen/gengate/v1/jobs_pb.js";
import {
  GenerateRequestSchema,
  GenerationService,
  type GenerateRequest,
  type GenerateResponse,
  type GenerateStreamResponse,
} from "./gen/gengate/v1/generation_pb.js";
import { StructuredOutputSchema, type ModelInfo } from "./gen/gengate/v1/types_pb.js";
import { BatchJobs } from "./jobs.js";
import { retryInterceptor, retryPolicy, type RetryPolicy } from "./retry.js";
import { jsonSchema, parseGeneration, schemaFromZod } from "./structured.js";
import { tracingInterceptor, type TracingOptions } from "./tracing.js";

export type GenerateRequestInit = MessageInitShape<typeof GenerateRequestSchema>;
/** The plain-object fields of a request (no $typeName). */
type RequestFields = Exclude<GenerateRequestInit, GenerateRequest>;

/** TLS settings; `true` means TLS with the system roots. */
export interface TlsOptions {
  /** PEM of the CA(s) to trust instead of the system roots. */
  ca?: string | Buffer;
  /** PEM client certificate and key, for mutual TLS. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** Name to verify the server certificate against, when it differs from the host. */
  servername?: string;
}

export interface ClientOptions extends TracingOptions {
  /** "host:port", or a URL ("http://host:port" for plaintext, "https://..." for TLS). */
  address: string;
  /** TLS (default: on for https:// URLs, off for "host:port" and http://). */
  tls?: boolean | TlsOptions;
  /** Sent as "authorization: Bearer <token>" on every call. */
  token?: string;
  /** gRPC metadata sent on every call. */
  metadata?: Record<string, string>;
  /** Deadline of every call that sets none, in milliseconds. */
  timeoutMs?: number;
  /** Set false to send no trace context and make no client spans. */
  tracing?: boolean;
  /** Extra connect interceptors, run after tracing (and, like it, once per attempt). */
  interceptors?: Interceptor[];
  /**
   * How calls are retried (fields left out: DEFAULT_RETRY_POLICY's): UNAVAILABLE and
   * RESOURCE_EXHAUSTED, up to 2 retries, waiting the server's pushback or a backoff; see retry.ts.
   */
  retry?: Partial<RetryPolicy>;
  /** Retries of a call, over `retry.maxRetries` (default 2; 0: none; at most 4). */
  maxRetries?: number;
}

export interface CallOptions {
  /** Aborting the signal cancels the call on the server. */
  signal?: AbortSignal;
  /** Deadline of this call in milliseconds; it travels to the server as grpc-timeout. */
  timeoutMs?: number;
  /** Extra gRPC metadata for this call. */
  metadata?: Record<string, string>;
  /** Bearer token for this call, replacing the client's. */
  token?: string;
}

/** The outcome of one request of a batch: a response or that item's own error. */
export type BatchItem =
  | { index: number; response: GenerateResponse; error?: undefined }
  | { index: number; response?: undefined; error: GengateError };

/** A decoded structured result plus the full response (usage, enforcement, seed, ...). */
export interface ObjectResult<T> {
  object: T;
  response: GenerateResponse;
}

/** A request for raw prompt text. */
export function prompt(
  model: string,
  text: string,
  rest: Omit<RequestFields, "model" | "input"> = {},
): GenerateRequest {
  return create(GenerateRequestSchema, { ...rest, model, input: { case: "prompt", value: text } });
}

function baseUrl(address: string, tls: ClientOptions["tls"]): string {
  if (/^https?:\/\//.test(address)) {
    if (tls && address.startsWith("http://")) return "https://" + address.slice("http://".length);
    return address;
  }
  return `${tls ? "https" : "http"}://${address}`;
}

/** A client of one gengate server. Every method accepts an AbortSignal and a deadline. */
export class GengateClient {
  private readonly rpc: ConnectClient<typeof GenerationService>;
  private readonly options: ClientOptions;
  /** Durable batch jobs (the BatchJobService), over the same connection and options. */
  readonly batchJobs: BatchJobs;

  constructor(options: ClientOptions) {
    this.options = options;
    const tls = typeof options.tls === "object" ? options.tls : {};
    const interceptors: Interceptor[] = [];
    // Outermost: each attempt gets its own client span and the caller's interceptors, as in Go.
    const retry = retryPolicy(options.retry, options.maxRetries);
    if (retry.maxRetries > 0) interceptors.push(retryInterceptor(retry));
    if (options.tracing !== false) interceptors.push(tracingInterceptor(options));
    interceptors.push(...(options.interceptors ?? []));
    const transport = createGrpcTransport({
      baseUrl: baseUrl(options.address, options.tls),
      interceptors,
      nodeOptions: { ...tls },
      ...(options.timeoutMs !== undefined ? { defaultTimeoutMs: options.timeoutMs } : {}),
    });
    this.rpc = createClient(GenerationService, transport);
    this.batchJobs = new BatchJobs(createClient(BatchJobService, transport), (o) => this.callOptions(o));
  }

  private callOptions(options: CallOptions = {}) {
    const headers: Record<string, string> = { ...this.options.metadata, ...options.metadata };
    const token = options.token ?? this.options.token;
    if (token !== undefined) headers["authorization"] = `Bearer ${token}`;
    return {
      headers,
      ...(options.signal ? { signal: options.signal } : {}),
      ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
    };
  }

  /** Runs one request to completion. */
  async generate(request: GenerateRequestInit, options?: CallOptions): Promise<GenerateResponse> {
    try {
      return await this.rpc.generate(request, this.callOptions(options));
    } catch (e) {
      throw GengateError.from(e);
    }
  }

  /**
   * Yields one start frame, the text deltas, then one end frame per generation. Leaving the
   * loop early (break, return, throw) cancels the call on the server.
   */
  async *generateStream(request: GenerateRequestInit, options?: CallOptions): AsyncGenerator<GenerateStreamResponse> {
    const controller = new AbortController();
    const outer = options?.signal;
    const onAbort = (): void => controller.abort(outer?.reason);
    if (outer?.aborted) onAbort();
    outer?.addEventListener("abort", onAbort, { once: true });
    try {
      yield* this.rpc.generateStream({ request }, this.callOptions({ ...options, signal: controller.signal }));
    } catch (e) {
      throw GengateError.from(e);
    } finally {
      outer?.removeEventListener("abort", onAbort);
      controller.abort();
    }
  }

  /** Runs many requests; yields each item as it completes. A bad item never fails the batch. */
  async *batchGenerate(requests: GenerateRequestInit[], options?: CallOptions): AsyncGenerator<BatchItem> {
    const controller = new AbortController();
    const outer = options?.signal;
    const onAbort = (): void => controller.abort(outer?.reason);
    if (outer?.aborted) onAbort();
    outer?.addEventListener("abort", onAbort, { once: true });
    try {
      const stream = this.rpc.batchGenerate({ requests }, this.callOptions({ ...options, signal: controller.signal }));
      for await (const item of stream) {
        if (item.result.case === "response") {
          yield { index: item.index, response: item.result.value };
        } else if (item.result.case === "error") {
          yield { index: item.index, error: GengateError.fromStatus(item.result.value) };
        }
      }
    } catch (e) {
      throw GengateError.from(e);
    } finally {
      outer?.removeEventListener("abort", onAbort);
      controller.abort();
    }
  }

  /** Which models are served and what each can do. */
  async listModels(options?: CallOptions): Promise<ModelInfo[]> {
    try {
      return (await this.rpc.listModels({}, this.callOptions(options))).models;
    } catch (e) {
      throw GengateError.from(e);
    }
  }

  /**
   * Asks for output shaped like the zod schema: sends its JSON Schema as the structured
   * output, then parses and validates the first generation with the schema itself.
   */
  async generateObject<S extends z.ZodType>(
    schema: S,
    request: GenerateRequestInit,
    options?: CallOptions & { name?: string },
  ): Promise<ObjectResult<z.output<S>>> {
    const full = create(GenerateRequestSchema, request);
    const structured = create(StructuredOutputSchema, jsonSchema(schemaFromZod(schema), options?.name ?? "output"));
    structured.options = full.structuredOutput?.options;
    const response = await this.generate({ ...full, structuredOutput: structured }, options);
    return { object: parseGeneration(schema, response.generations[0]), response };
  }
}

/** Makes a GengateClient. */
export function createGengateClient(options: ClientOptions): GengateClient {
  return new GengateClient(options);
}
