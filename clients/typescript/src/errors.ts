/** Errors of calls and batch items: the gRPC code plus the google.rpc details, decoded. */
import { createRegistry, type Registry } from "@bufbuild/protobuf";
import { anyUnpack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";

import {
  BadRequestSchema,
  ErrorInfoSchema,
  RetryInfoSchema,
  type BadRequest,
  type ErrorInfo,
  type RetryInfo,
} from "./gen/google/rpc/error_details_pb.js";
import type { Status } from "./gen/google/rpc/status_pb.js";

export { Code };

/** A request field that was wrong and why (google.rpc.BadRequest). */
export interface FieldViolation {
  field: string;
  description: string;
  reason: string;
}

const detailRegistry: Registry = createRegistry(ErrorInfoSchema, BadRequestSchema, RetryInfoSchema);

/** gRPC code names as in the gRPC spec ("NOT_FOUND", "CANCELLED"), indexed by numeric code. */
const CODE_NAMES = Object.fromEntries(
  Object.entries(Code)
    .filter(([, v]) => typeof v === "number")
    .map(([k, v]) => [v, k.replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase()]),
) as Record<number, string>;
CODE_NAMES[Code.Canceled] = "CANCELLED"; // connect spells it "Canceled"; gRPC, Python and Go "CANCELLED"

/**
 * GengateError is a failed call or batch item. `code` is the gRPC status code (the numbers
 * are the same in connect's `Code`), `codeName` its spec name, and reason, field violations
 * and retry delay come from the google.rpc details the server attached.
 */
export class GengateError extends Error {
  override readonly name = "GengateError";
  readonly codeName: string;
  reason = "";
  domain = "";
  metadata: Record<string, string> = {};
  fieldViolations: FieldViolation[] = [];
  /** From google.rpc.RetryInfo; undefined when absent. */
  retryDelayMs: number | undefined;

  constructor(
    readonly code: Code,
    readonly rawMessage: string,
    details: readonly unknown[] = [],
    options?: { cause?: unknown },
  ) {
    super(`${CODE_NAMES[code] ?? code}: ${rawMessage}`, options);
    this.codeName = CODE_NAMES[code] ?? String(code);
    for (const detail of details) this.addDetail(detail);
    if (this.reason) this.message += ` (${this.reason})`;
    for (const v of this.fieldViolations) this.message += `; ${v.field}: ${v.description}`;
  }

  /** The violation for `field`, if the server reported one. */
  field(field: string): FieldViolation | undefined {
    return this.fieldViolations.find((v) => v.field === field);
  }

  private addDetail(detail: unknown): void {
    const d = detail as { $typeName?: string };
    if (d.$typeName === "google.rpc.ErrorInfo") {
      const info = detail as ErrorInfo;
      this.reason = info.reason;
      this.domain = info.domain;
      this.metadata = { ...info.metadata };
    } else if (d.$typeName === "google.rpc.BadRequest") {
      for (const v of (detail as BadRequest).fieldViolations) {
        this.fieldViolations.push({ field: v.field, description: v.description, reason: v.reason });
      }
    } else if (d.$typeName === "google.rpc.RetryInfo") {
      const delay = (detail as RetryInfo).retryDelay;
      if (delay) this.retryDelayMs = Number(delay.seconds) * 1000 + delay.nanos / 1e6;
    }
  }

  /** Converts anything a call threw (ConnectError, AbortError, ...) into a GengateError. */
  static from(reason: unknown): GengateError {
    if (reason instanceof GengateError) return reason;
    const err = ConnectError.from(reason);
    return new GengateError(err.code, err.rawMessage, err.findDetails(detailRegistry), {
      cause: reason,
    });
  }

  /** Converts a google.rpc.Status (a batch item's error) into a GengateError. */
  static fromStatus(status: Status): GengateError {
    const details = status.details
      .map((any) => anyUnpack(any, detailRegistry))
      .filter((m) => m !== undefined);
    return new GengateError(status.code as Code, status.message, details);
  }
}

/**
 * A structured generation was cut at max_tokens (finish reason LENGTH) before it was complete:
 * raise max_tokens. Thrown before any parse, as the Python and Go clients do.
 */
export class TruncatedOutputError extends Error {
  override readonly name = "TruncatedOutputError";
  constructor(
    message: string,
    readonly text: string,
  ) {
    super(message);
  }
}

/** The server's output did not match the requested schema (the server should never allow it). */
export class InvalidOutputError extends Error {
  override readonly name = "InvalidOutputError";
  constructor(
    message: string,
    readonly text: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}
