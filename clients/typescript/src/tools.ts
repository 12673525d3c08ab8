/** Tool calling: tools from zod schemas, typed arguments, tool choices and conversations that go on. */
import type { MessageInitShape } from "@bufbuild/protobuf";
import type { z } from "zod";

import type { GenerateRequestInit } from "./client.js";
import { InvalidOutputError } from "./errors.js";
import type { GenerateRequest, GenerateStreamResponse } from "./gen/gengate/v1/generation_pb.js";
import {
  Role,
  ToolChoiceMode,
  type ChatMessageSchema,
  type Generation,
  type ToolCall,
  type ToolChoiceSchema,
  type ToolSchema,
} from "./gen/gengate/v1/types_pb.js";
import { parseWithZod, schemaFromZod } from "./structured.js";

export type ToolInit = MessageInitShape<typeof ToolSchema>;
export type ToolChoiceInit = MessageInitShape<typeof ToolChoiceSchema>;
export type ChatMessageInit = MessageInitShape<typeof ChatMessageSchema>;

/** What `tool()` takes: the arguments as a zod schema (an object schema). */
export interface ToolSpec<N extends string, S extends z.ZodType> {
  /** 1-64 characters of [A-Za-z0-9_-], unique within the request. */
  name: N;
  description?: string;
  parameters: S;
  /** Ask the provider for its strict mode where it has one (the server validates either way). */
  strict?: boolean;
}

/**
 * A tool made from a zod schema. It is a gengate.v1 Tool init (`tools: [weather]` sends it) that
 * also keeps its schema, so `parse` returns a call's arguments typed by it.
 */
export interface ZodTool<N extends string = string, S extends z.ZodType = z.ZodType> {
  readonly name: N;
  readonly description: string;
  /** The schema's JSON Schema, as sent (`schemaFromZod`, the structured-output path). */
  readonly parametersJson: string;
  readonly strict: boolean;
  readonly parameters: S;
  /** The call's arguments parsed and validated with the schema; InvalidOutputError when they do not match or the call is another tool's. */
  parse(call: ToolCall): z.output<S>;
}

/** A tool whose arguments are the zod schema's: `tool({ name: "get_weather", parameters: z.object({ city: z.string() }) })`. */
export function tool<const N extends string, S extends z.ZodType>(spec: ToolSpec<N, S>): ZodTool<N, S> {
  return {
    name: spec.name,
    description: spec.description ?? "",
    parametersJson: JSON.stringify(schemaFromZod(spec.parameters)),
    strict: spec.strict ?? false,
    parameters: spec.parameters,
    parse(call: ToolCall): z.output<S> {
      if (call.name !== spec.name) {
        throw new InvalidOutputError(`tool call ${call.id} is to ${JSON.stringify(call.name)}, not ${JSON.stringify(spec.name)}`, call.argumentsJson);
      }
      return parseArguments(spec.parameters, call);
    },
  };
}

function parseArguments<S extends z.ZodType>(schema: S, call: ToolCall): z.output<S> {
  try {
    return parseWithZod(schema, call.argumentsJson === "" ? "{}" : call.argumentsJson);
  } catch (e) {
    if (!(e instanceof InvalidOutputError)) throw e;
    throw new InvalidOutputError(`tool call ${call.id} (${call.name}): ${e.message}`, call.argumentsJson, { cause: e.cause });
  }
}

/** One call parsed by `parseToolCalls`: which tool (`name` narrows `arguments`), its id and its typed arguments. */
export type ParsedToolCall<T extends readonly ZodTool[]> = {
  [K in keyof T]: T[K] extends ZodTool<infer N, infer S> ? { id: string; name: N; arguments: z.output<S> } : never;
}[number];

/**
 * Every call of a generation (or a list of calls), each parsed by the tool it names; switch on
 * `name` to get its arguments' type. InvalidOutputError for a call to a tool not given.
 */
export function parseToolCalls<const T extends readonly ZodTool[]>(
  calls: Generation | readonly ToolCall[] | undefined,
  tools: T,
): ParsedToolCall<T>[] {
  const list = calls === undefined ? [] : "toolCalls" in calls ? calls.toolCalls : calls;
  return list.map((call) => {
    const known = tools.find((t) => t.name === call.name);
    if (!known) {
      throw new InvalidOutputError(
        `tool call ${call.id} is to ${JSON.stringify(call.name)}, none of ${tools.map((t) => t.name).join(", ")}`,
        call.argumentsJson,
      );
    }
    return { id: call.id, name: call.name, arguments: known.parse(call) } as ParsedToolCall<T>;
  });
}

/** A tool choice by name: "auto" (the default), "none" (the tools are context only), "required" (at least one call), or `{ name }` (exactly that tool). */
export type ToolChoiceOption = "auto" | "none" | "required" | { name: string };

const MODES = { auto: ToolChoiceMode.AUTO, none: ToolChoiceMode.NONE, required: ToolChoiceMode.REQUIRED } as const;

/** The gengate.v1 ToolChoice of a choice by name. */
export function toolChoice(choice: ToolChoiceOption): ToolChoiceInit {
  if (typeof choice === "object") return { choice: { case: "name", value: choice.name } };
  if (!Object.hasOwn(MODES, choice)) {
    throw new TypeError(`unknown tool choice ${JSON.stringify(choice)}; expected auto, none, required or { name }`);
  }
  return { choice: { case: "mode", value: MODES[choice] } };
}

export interface ToolOptions {
  /** Whether and which tool must be called (unset: the server's default, auto). */
  choice?: ToolChoiceOption;
  /** Allow (true) or forbid (false) several calls in one turn (unset: the backend's default). */
  parallelToolCalls?: boolean;
}

type ToolFields = Pick<Exclude<GenerateRequestInit, GenerateRequest>, "tools" | "toolChoice" | "parallelToolCalls">;

/** The request fields that offer `tools`, to spread into a request: `prompt(model, text, { ...withTools([weather], { choice: "required" }) })`. */
export function withTools(tools: readonly ToolInit[], options: ToolOptions = {}): ToolFields {
  return {
    tools: [...tools],
    ...(options.choice !== undefined ? { toolChoice: toolChoice(options.choice) } : {}),
    ...(options.parallelToolCalls !== undefined ? { parallelToolCalls: options.parallelToolCalls } : {}),
  };
}

/** The ROLE_TOOL message answering call `callId` with `result`. */
export function toolMessage(callId: string, result: string): ChatMessageInit {
  return { role: Role.TOOL, toolCallId: callId, content: [{ part: { case: "text", value: result } }] };
}

/** The assistant turn a generation was, to send back: its text (if any), its tool calls and its reasoning. */
export function assistantMessage(generation: Generation): ChatMessageInit {
  return {
    role: Role.ASSISTANT,
    content: generation.text === "" ? [] : [{ part: { case: "text", value: generation.text } }],
    toolCalls: generation.toolCalls,
    ...(generation.reasoning ? { reasoning: generation.reasoning } : {}),
  };
}

/**
 * The conversation after `generation` called tools: a copy of `messages`, then its assistant turn
 * and one ROLE_TOOL message per call, in the calls' order, holding `results[call id]`. Every call
 * needs a result and every result a call (TypeError otherwise).
 */
export function withToolResults(
  messages: readonly ChatMessageInit[],
  generation: Generation | undefined,
  results: Record<string, string> | ReadonlyMap<string, string>,
): ChatMessageInit[] {
  const calls = generation?.toolCalls ?? [];
  if (!generation || calls.length === 0) throw new TypeError(`generation ${generation?.index ?? "(none)"} made no tool call`);
  const byId = results instanceof Map ? results : new Map(Object.entries(results));
  const answered = calls.map((call) => {
    const result = byId.get(call.id);
    if (result === undefined) throw new TypeError(`no result for tool call ${call.id} (${call.name})`);
    return toolMessage(call.id, result);
  });
  const ids = new Set(calls.map((c) => c.id));
  for (const id of byId.keys()) {
    if (!ids.has(id)) throw new TypeError(`a result for ${JSON.stringify(id)}, which is no tool call of generation ${generation.index}`);
  }
  return [...messages, assistantMessage(generation), ...answered];
}

/**
 * A stream's tool calls per generation: `partial` assembles the fragments as they arrive; `final`
 * is the end frame's complete calls, the ones the server validated. Feed it every frame with `add`.
 */
export class StreamToolCalls {
  private readonly fragments = new Map<number, { id: string; name: string; argumentsJson: string }[]>();
  private readonly ended = new Map<number, ToolCall[]>();

  /** Takes one frame: a delta's fragments join their calls, an end frame's calls become final. */
  add(frame: GenerateStreamResponse): void {
    if (frame.frame.case === "delta") {
      const delta = frame.frame.value;
      const calls = this.fragments.get(delta.index) ?? [];
      for (const fragment of delta.toolCalls) {
        while (calls.length <= fragment.index) calls.push({ id: "", name: "", argumentsJson: "" });
        const call = calls[fragment.index]!;
        if (fragment.id !== "") call.id = fragment.id;
        if (fragment.name !== "") call.name = fragment.name;
        call.argumentsJson += fragment.argumentsFragment;
      }
      this.fragments.set(delta.index, calls);
    } else if (frame.frame.case === "end") {
      this.ended.set(frame.frame.value.index, frame.frame.value.toolCalls);
    }
  }

  /**
   * Generation `index`'s calls assembled from the fragments so far: not validated yet, and an id may
   * be empty where the backend gave none (the end frame carries the server's).
   */
  partial(index = 0): { id: string; name: string; argumentsJson: string }[] {
    return (this.fragments.get(index) ?? []).map((c) => ({ ...c }));
  }

  /** Generation `index`'s complete, validated calls from its end frame; undefined until it has come. */
  final(index = 0): ToolCall[] | undefined {
    return this.ended.get(index);
  }
}
