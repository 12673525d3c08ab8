/** Structured-output constraints, and zod schemas turned into JSON Schema and back. */
import type { JsonObject, MessageInitShape } from "@bufbuild/protobuf";
import { z } from "zod";

import { InvalidOutputError, TruncatedOutputError } from "./errors.js";
import { FinishReason, GrammarSyntax, type Generation, type StructuredOutputSchema } from "./gen/gengate/v1/types_pb.js";

export type StructuredOutputInit = MessageInitShape<typeof StructuredOutputSchema>;

/**
 * Output must be JSON valid against `schema` (JSON Schema Draft 2020-12), given as an object or
 * as JSON text. It travels as JSON text (`schemaJson`), so property order survives; pass text to
 * keep integers beyond 2^53 exact, or integer-like property names in their written order.
 */
export function jsonSchema(schema: JsonObject | string, name = "output", strict = false): StructuredOutputInit {
  const schemaJson = typeof schema === "string" ? schema : JSON.stringify(schema);
  const parsed: unknown = JSON.parse(schemaJson);
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw new TypeError("a JSON Schema must be a JSON object");
  }
  return { kind: { case: "jsonSchema", value: { schemaJson, name, strict } } };
}

/** Output must fully match the regular expression. */
export function regex(pattern: string): StructuredOutputInit {
  return { kind: { case: "regex", value: { pattern } } };
}

/** Output must be exactly one of the strings. */
export function choice(...choices: string[]): StructuredOutputInit {
  return { kind: { case: "choice", value: { choices } } };
}

/** Output must be a sentence of the Lark grammar. */
export function larkGrammar(definition: string): StructuredOutputInit {
  return { kind: { case: "grammar", value: { syntax: GrammarSyntax.LARK, definition } } };
}

/** Output must be any JSON object. */
export function jsonObject(): StructuredOutputInit {
  return { kind: { case: "jsonObject", value: {} } };
}

/**
 * The JSON Schema of a zod schema, as sent to the server. Objects refuse unknown keys, since
 * zod's default object strips them and the model should not spend tokens on them.
 */
export function schemaFromZod(schema: z.ZodType): JsonObject {
  const json = z.toJSONSchema(schema, { target: "draft-2020-12", io: "output" }) as JsonObject;
  delete json["$schema"];
  return json;
}

/** Parses `text` as JSON and validates it with the zod schema. */
export function parseWithZod<S extends z.ZodType>(schema: S, text: string): z.output<S> {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (cause) {
    throw new InvalidOutputError(`output is not JSON: ${String(cause)}`, text, { cause });
  }
  const result = schema.safeParse(value);
  if (!result.success) {
    throw new InvalidOutputError(`output does not match the schema: ${result.error.message}`, text, {
      cause: result.error,
    });
  }
  return result.data;
}

/**
 * One generation of a structured request, parsed with the zod schema: TruncatedOutputError when it
 * was cut at max_tokens (before any parse), else as parseWithZod.
 */
export function parseGeneration<S extends z.ZodType>(schema: S, generation: Generation | undefined): z.output<S> {
  if (generation?.finishReason === FinishReason.LENGTH) {
    throw new TruncatedOutputError(
      `generation ${generation.index} stopped at ${generation.outputTokens} tokens, before the structured output was complete; raise maxTokens`,
      generation.text,
    );
  }
  return parseWithZod(schema, generation?.text ?? "");
}
