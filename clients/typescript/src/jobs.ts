/** BatchJobs (`client.batchJobs`): durable batch jobs over the generated BatchJobService client. */
import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code, type CallOptions as ConnectCallOptions, type Client as ConnectClient } from "@connectrpc/connect";

import type { BatchItem, CallOptions, GenerateRequestInit } from "./client.js";
import { GengateError } from "./errors.js";
import {
  type BatchJob,
  type BatchJobHeaderSchema,
  BatchJobService,
  type UploadBatchJobRequestSchema,
} from "./gen/gengate/v1/jobs_pb.js";

/** Jobs of more requests than this (or with `defaults`) are sent with the streaming upload. */
export const UPLOAD_ABOVE = 1000;

type HeaderInit = MessageInitShape<typeof BatchJobHeaderSchema>;
type UploadPart = MessageInitShape<typeof UploadBatchJobRequestSchema>;

/** An upload message with no part: the server refuses it, and the upload with it (it runs none of it). */
const ABANDON: UploadPart = { part: { case: undefined } };

export interface CreateJobOptions extends CallOptions {
  /** A name for people; not unique. */
  displayName?: string;
  /** A create retried with a key already used returns that job instead of making another. */
  idempotencyKey?: string;
  /** Run through the model's provider batch API: about half the price, results within a day. */
  offline?: boolean;
  /** Higher runs first among queued jobs (default 0). Jobs always yield to interactive calls. */
  priority?: number;
  /** Items of this job in flight at once (default: the server's). */
  maxConcurrency?: number;
  /** Fields every item starts from (model, sampling, ...); an item's own fields override them. */
  defaults?: GenerateRequestInit;
}

export interface ListJobsOptions extends CallOptions {
  /** Jobs fetched per call (default: the server's, 50; at most 1000). */
  pageSize?: number;
}

export interface ResultsOptions extends CallOptions {
  /** Start after this item's index (resume a download); unset: from the first item. */
  afterIndex?: number | bigint;
  /** Wait for items still running, until the job's last item (default true). With false the
   * stream ends at the first item not finished. */
  follow?: boolean;
}

/** An AbortController that follows `outer`; `release` unlinks it and ends the call. */
function linked(outer: AbortSignal | undefined): { controller: AbortController; release(): void } {
  const controller = new AbortController();
  const onAbort = (): void => controller.abort(outer?.reason);
  if (outer?.aborted) onAbort();
  outer?.addEventListener("abort", onAbort, { once: true });
  return {
    controller,
    release: () => {
      outer?.removeEventListener("abort", onAbort);
      controller.abort();
    },
  };
}

function required(job: BatchJob | undefined): BatchJob {
  if (!job) throw new GengateError(Code.Internal, "the server answered without the job");
  return job;
}

/** The job's settings, as CreateBatchJobRequest and BatchJobHeader both hold them. */
function jobFields(options: CreateJobOptions) {
  return {
    displayName: options.displayName ?? "",
    idempotencyKey: options.idempotencyKey ?? "",
    options: {
      offline: options.offline ?? false,
      priority: options.priority ?? 0,
      maxConcurrency: options.maxConcurrency ?? 0,
    },
  };
}

function header(options: CreateJobOptions): HeaderInit {
  return { ...jobFields(options), ...(options.defaults !== undefined ? { defaults: options.defaults } : {}) };
}

/** Lines of a JSONL text or of an iterable of lines, without their line ends; blank ones skipped. */
async function* jsonLines(lines: string | Iterable<string> | AsyncIterable<string>): AsyncGenerator<UploadPart> {
  const source = typeof lines === "string" ? lines.split("\n") : lines;
  for await (const line of source) {
    const text = line.replace(/\r?\n$/, "").replace(/\r$/, "");
    if (text.trim() !== "") yield { part: { case: "jsonLine", value: text } };
  }
}

/**
 * The BatchJobService of one GengateClient: jobs the server stores and runs whatever the caller
 * does after creating one, with results read back in index order from any index.
 */
export class BatchJobs {
  constructor(
    private readonly rpc: ConnectClient<typeof BatchJobService>,
    private readonly callOptions: (options?: CallOptions) => ConnectCallOptions,
  ) {}

  /**
   * Stores a job of `requests` and returns it at once, queued. More than UPLOAD_ABOVE requests
   * (or `defaults`) go with the client-streaming upload; the job is the same.
   */
  async create(requests: GenerateRequestInit[], options: CreateJobOptions = {}): Promise<BatchJob> {
    if (requests.length <= UPLOAD_ABOVE && options.defaults === undefined) {
      try {
        const reply = await this.rpc.createBatchJob({ ...jobFields(options), requests }, this.callOptions(options));
        return required(reply.job);
      } catch (e) {
        throw GengateError.from(e);
      }
    }
    return this.upload(
      header(options),
      (function* () {
        for (const value of requests) yield { part: { case: "request", value } } as UploadPart;
      })(),
      options,
    );
  }

  /**
   * Uploads a job of JSONL lines, parsed by the server: each a JSON object of GenerateRequest
   * fields (`prompt` as text, `messages` as {role, content} objects), usually with `defaults`
   * for the model. Give the text, or its lines (an array, or `readline` over a file stream).
   * Blank lines are skipped; a line the server cannot read is that item's INVALID_ARGUMENT. If
   * the lines' source throws, the upload is abandoned (the server runs none of it) and its error
   * is thrown.
   */
  async createFromJsonl(
    lines: string | Iterable<string> | AsyncIterable<string>,
    options: CreateJobOptions = {},
  ): Promise<BatchJob> {
    return this.upload(header(options), jsonLines(lines), options);
  }

  private async upload(
    header: HeaderInit,
    items: Iterable<UploadPart> | AsyncIterable<UploadPart>,
    options: CallOptions,
  ): Promise<BatchJob> {
    const call = linked(options.signal);
    let failure: { error: unknown } | undefined;
    async function* parts(): AsyncGenerator<UploadPart> {
      yield { part: { case: "header", value: header } };
      try {
        yield* items;
      } catch (error) {
        failure = { error };
        // Node's HTTP/2 client ends the request stream before it resets it, so a server could
        // take an abandoned upload for a whole one: a message that is no item (the server
        // refuses it, and the upload with it) goes first.
        yield ABANDON;
        call.controller.abort(error);
        throw error;
      }
    }
    try {
      const reply = await this.rpc.uploadBatchJob(parts(), this.callOptions({ ...options, signal: call.controller.signal }));
      return required(reply.job);
    } catch (e) {
      if (failure) throw failure.error;
      throw GengateError.from(e);
    } finally {
      call.release();
    }
  }

  /** Where a job stands: state, counts, times and usage so far. Unknown id: NOT_FOUND. */
  async get(id: string, options?: CallOptions): Promise<BatchJob> {
    try {
      return required((await this.rpc.getBatchJob({ id }, this.callOptions(options))).job);
    } catch (e) {
      throw GengateError.from(e);
    }
  }

  /** Every job, newest first, fetched a page at a time; leaving the loop fetches no more. */
  async *list(options: ListJobsOptions = {}): AsyncGenerator<BatchJob> {
    let pageToken = "";
    do {
      let page;
      try {
        page = await this.rpc.listBatchJobs({ pageSize: options.pageSize ?? 0, pageToken }, this.callOptions(options));
      } catch (e) {
        throw GengateError.from(e);
      }
      yield* page.jobs;
      pageToken = page.nextPageToken;
    } while (pageToken);
  }

  /**
   * Stops a job: items not finished end with a CANCELLED error. A job that has ended:
   * GengateError FAILED_PRECONDITION (reason JOB_FINISHED).
   */
  async cancel(id: string, options?: CallOptions): Promise<BatchJob> {
    try {
      return required((await this.rpc.cancelBatchJob({ id }, this.callOptions(options))).job);
    } catch (e) {
      throw GengateError.from(e);
    }
  }

  /**
   * Each finished item in index order, from `afterIndex + 1`: `{index, response}` or, for an
   * item that failed, `{index, error}` (a GengateError). Only a failure of the stream itself
   * (an unknown id: NOT_FOUND) throws. Leaving the loop early cancels the stream.
   */
  async *results(id: string, options: ResultsOptions = {}): AsyncGenerator<BatchItem> {
    const call = linked(options.signal);
    const request = {
      id,
      follow: options.follow ?? true,
      ...(options.afterIndex !== undefined ? { afterIndex: BigInt(options.afterIndex) } : {}),
    };
    try {
      const stream = this.rpc.streamBatchJobResults(request, this.callOptions({ ...options, signal: call.controller.signal }));
      for await (const item of stream) {
        const index = Number(item.index);
        if (item.result.case === "response") {
          yield { index, response: item.result.value };
        } else if (item.result.case === "error") {
          yield { index, error: GengateError.fromStatus(item.result.value) };
        }
      }
    } catch (e) {
      throw GengateError.from(e);
    } finally {
      call.release();
    }
  }
}
