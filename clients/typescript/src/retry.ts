/**
 * Client retries as a connect interceptor: the same policy as the Go client's (gRPC's own retry,
 * gRFC A6) and the Python client's, since connect-node has no retry service config.
 */
import { Code, ConnectError, type Interceptor, type StreamRequest, type StreamResponse, type UnaryRequest } from "@connectrpc/connect";

/** How a client retries a failed call (ClientOptions `retry`, `maxRetries`). */
export interface RetryPolicy {
  /** Retries of one call (attempts: maxRetries + 1); 0 turns retries off. At most 4: gRPC caps attempts at 5. */
  maxRetries: number;
  /** Backoff before the first retry, at most (without a server pushback). */
  initialBackoffMs: number;
  /** The longest backoff. */
  maxBackoffMs: number;
  /** Each retry's backoff bound is the previous one's times this. */
  backoffMultiplier: number;
  /** Codes retried. */
  retryableCodes: Code[];
}

/** 2 retries (3 attempts), backoff 0.2 s doubling up to 5 s, on UNAVAILABLE and RESOURCE_EXHAUSTED. */
export const DEFAULT_RETRY_POLICY: Readonly<RetryPolicy> = Object.freeze({
  maxRetries: 2,
  initialBackoffMs: 200,
  maxBackoffMs: 5000,
  backoffMultiplier: 2,
  retryableCodes: Object.freeze([Code.Unavailable, Code.ResourceExhausted]) as Code[],
});

/** The most retries: gRPC makes at most 5 attempts of a call. */
export const MAX_RETRIES_LIMIT = 4;

/**
 * The methods retried: every GenerationService method; of the BatchJobService only the
 * idempotent ones (CreateBatchJob and UploadBatchJob would make a second job).
 */
const RETRIED: Readonly<Record<string, readonly string[] | "all">> = {
  "gengate.v1.GenerationService": "all",
  "gengate.v1.BatchJobService": ["GetBatchJob", "ListBatchJobs", "CancelBatchJob", "StreamBatchJobResults"],
};

function retried(service: string, method: string): boolean {
  const methods = RETRIED[service];
  return methods === "all" || (methods !== undefined && methods.includes(method));
}

/** The policy of `retry` and `maxRetries` over the defaults; throws for values gRPC would refuse. */
export function retryPolicy(retry: Partial<RetryPolicy> = {}, maxRetries?: number): RetryPolicy {
  const defined = Object.fromEntries(Object.entries(retry).filter(([, v]) => v !== undefined)) as Partial<RetryPolicy>;
  const policy: RetryPolicy = {
    ...DEFAULT_RETRY_POLICY,
    ...defined,
    retryableCodes: [...(defined.retryableCodes ?? DEFAULT_RETRY_POLICY.retryableCodes)],
  };
  if (maxRetries !== undefined) policy.maxRetries = maxRetries;
  if (!Number.isInteger(policy.maxRetries) || policy.maxRetries < 0 || policy.maxRetries > MAX_RETRIES_LIMIT) {
    throw new RangeError(
      `maxRetries ${policy.maxRetries}: want an integer from 0 to ${MAX_RETRIES_LIMIT} (gRPC makes at most ${MAX_RETRIES_LIMIT + 1} attempts)`,
    );
  }
  for (const [name, value] of [
    ["initialBackoffMs", policy.initialBackoffMs],
    ["maxBackoffMs", policy.maxBackoffMs],
    ["backoffMultiplier", policy.backoffMultiplier],
  ] as const) {
    if (!Number.isFinite(value) || value <= 0) throw new RangeError(`${name} ${value}: want a number above 0`);
  }
  if (policy.retryableCodes.some((c) => !(c in Code) || c === (0 as Code))) {
    throw new RangeError(`retryableCodes ${policy.retryableCodes.join(",")}: want gRPC error codes`);
  }
  return policy;
}

/** The deadline a gRPC request header carries (grpc-timeout), as a Date.now() time. */
function deadlineOf(header: Headers, start: number): number | undefined {
  const m = /^(\d{1,8})([HMSmun])$/.exec(header.get("grpc-timeout") ?? "");
  if (!m) return undefined;
  const unitMs = { H: 3_600_000, M: 60_000, S: 1000, m: 1, u: 1e-3, n: 1e-6 }[m[2] as "H" | "M" | "S" | "m" | "u" | "n"];
  return start + Number(m[1]) * unitMs;
}

/** Waits `ms`, or until `signal` aborts (then throws its reason). */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(signal.reason);
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

/** One call's retry state: its policy, deadline and signal. */
class Attempts {
  private readonly deadline: number | undefined;
  retries = 0;

  constructor(
    private readonly policy: RetryPolicy,
    private readonly req: UnaryRequest | StreamRequest,
  ) {
    this.deadline = deadlineOf(req.header, Date.now());
  }

  /** The request header of the next attempt: the remaining deadline as its grpc-timeout. */
  header(): Headers {
    const header = new Headers(this.req.header);
    if (this.retries > 0 && this.deadline !== undefined) {
      header.set("grpc-timeout", `${Math.max(1, Math.ceil(this.deadline - Date.now()))}m`);
    }
    return header;
  }

  /**
   * After a failed attempt: waits as the policy says and returns, or throws `error` (itself, not a
   * DEADLINE_EXCEEDED) when the call must not be retried.
   */
  async backOff(error: unknown): Promise<void> {
    const wait = this.waitMs(error);
    if (wait === undefined) throw error;
    try {
      await sleep(wait, this.req.signal);
    } catch (reason) {
      // the caller's abort ends the call as an abort would; the deadline as the last error
      const aborted = ConnectError.from(reason);
      throw aborted.code === Code.DeadlineExceeded ? error : aborted;
    }
    this.retries++;
  }

  /** How long to wait before the next attempt; undefined: no retry. */
  private waitMs(error: unknown): number | undefined {
    if (this.req.signal.aborted || this.retries >= this.policy.maxRetries) return undefined;
    const err = ConnectError.from(error);
    if (!this.policy.retryableCodes.includes(err.code)) return undefined;
    let wait: number;
    const pushback = err.metadata.get("grpc-retry-pushback-ms");
    if (pushback !== null) {
      // gRFC A6: wait exactly that long; negative ("do not retry") or unreadable: no retry
      if (!/^\d+$/.test(pushback.trim())) return undefined;
      wait = Number(pushback.trim());
    } else {
      const bound = Math.min(
        this.policy.initialBackoffMs * this.policy.backoffMultiplier ** this.retries,
        this.policy.maxBackoffMs,
      );
      wait = Math.random() * bound;
    }
    if (this.deadline !== undefined && Date.now() + wait >= this.deadline) return undefined;
    return wait;
  }
}

/** The messages of `first` (an iterator's first result) and then the rest of `rest`. */
async function* resumed<T>(first: IteratorResult<T>, rest: AsyncIterator<T>): AsyncGenerator<T> {
  if (first.done) return;
  yield first.value;
  yield* { [Symbol.asyncIterator]: () => rest };
}

async function* once<T>(items: readonly T[]): AsyncGenerator<T> {
  yield* items;
}

/**
 * Retries the calls `policy` allows: UNAVAILABLE and RESOURCE_EXHAUSTED (by default) of the
 * methods in RETRIED, waiting the server's grpc-retry-pushback-ms when the error carries it
 * (negative: no retry) or a random backoff under min(initial * multiplier^(n-1), max) otherwise.
 * The call's deadline covers every attempt: a wait that would pass it is not taken (the error is
 * thrown as it came). An aborted call is never retried. A server stream is retried only until
 * its first message, never after.
 */
export function retryInterceptor(policy: RetryPolicy): Interceptor {
  return (next) => async (req) => {
    if (policy.maxRetries === 0 || !retried(req.service.typeName, req.method.name)) return next(req);
    const attempts = new Attempts(policy, req);
    if (!req.stream) {
      for (;;) {
        try {
          return await next({ ...req, header: attempts.header() });
        } catch (e) {
          await attempts.backOff(e);
        }
      }
    }
    if (req.method.methodKind !== "server_streaming") return next(req);
    // A server-streaming call sends one message; its iterable is read once, so each attempt
    // gets a fresh one.
    const input = [];
    for await (const message of req.message) input.push(message);
    for (;;) {
      let messages: AsyncIterator<unknown> | undefined;
      try {
        const res = (await next({ ...req, header: attempts.header(), message: once(input) })) as StreamResponse;
        messages = res.message[Symbol.asyncIterator]();
        const first = await messages.next();
        // committed: from here on an error is the caller's
        return { ...res, message: resumed(first, messages) } as StreamResponse;
      } catch (e) {
        await messages?.return?.().catch(() => undefined);
        await attempts.backOff(e);
      }
    }
  };
}
