/**
 * TypeScript conformance runner: runs clients/conformance/vectors.json with @gengate/client and
 * prints {"language": "typescript", "results": [...]} as JSON (see clients/conformance/run).
 *
 *   node --import tsx conformance/runner.ts ADDRESS VECTORS
 */
import { readFileSync } from "node:fs";

import { create, equals, fromJson, type JsonValue } from "@bufbuild/protobuf";
import { z } from "zod";

import {
  ConstraintKind,
  Enforcement,
  FinishReason,
  GenerateRequestSchema,
  GengateClient,
  GengateError,
  MagpiePreset,
  MagpieSchema,
  StreamToolCalls,
  ToolChoiceMode,
  TruncatedOutputError,
  conversation,
  magpie,
  parseGeneration,
  withToolResults,
  withTools,
  type GenerateRequest,
  type GenerateResponse,
  type ToolCall,
  type ToolChoiceOption,
} from "../src/index.js";

interface Vector {
  name: string;
  call: string;
  request?: JsonValue;
  requests?: JsonValue[];
  expect: Record<string, unknown>;
  repeat?: number;
  timeout_ms?: number;
  cancel_after_deltas?: number;
  /** Options of a client made for this vector alone ({"max_retries": N}). */
  client?: Record<string, unknown>;
  /** Answers the first response's calls by id (call tool_round_trip). */
  tool_results?: Record<string, string>;
}

interface ErrorOut {
  code: string;
  reason: string;
  fields: string[];
}

/** The error's RetryInfo delay (checked, not observed), by the error it belongs to. */
const retryDelays = new WeakMap<ErrorOut, number | undefined>();

interface Outcome {
  error?: ErrorOut;
  texts?: string[];
  finishReasons?: string[];
  outputTokens?: number[];
  enforcement?: string;
  seed?: string | undefined;
  framesOrdered?: boolean;
  cancelled?: boolean;
  /** Each generation's Magpie turns (the client's `conversation()`), when any has some. */
  conversations?: TurnOut[][];
  /** Each generation's tool calls (a stream's: its end frames'). */
  toolCalls?: ToolCall[][];
  /** A stream's fragments, assembled by StreamToolCalls, had its end frames' names and arguments, and there was one at least. */
  fragmentsMatchEnd?: boolean;
}

/** One Magpie turn as every runner observes it (roles by their proto names). */
interface TurnOut {
  role: string;
  text: string;
  output_tokens: number;
}

/**
 * The expect keys this runner checks: check()'s, then those runVector reads itself (a vector's
 * expect), or "ok" (a batch item's). A key outside them fails its vector, so a vector can never
 * pass by being ignored.
 */
const CHECKED_KEYS = ["code", "reason", "field_violation", "generations", "max_output_tokens", "finish_reasons", "seed_echoed",
  "enforcement", "valid_json_schema", "full_match", "one_of", "json_object", "key_order", "frames_ordered", "cancelled", "retry_after_s",
  "conversation_roles", "tool_calls", "tool_fragments_match_end"];
const VECTOR_KEYS: ReadonlySet<string> = new Set([...CHECKED_KEYS, "model_listed", "constraint_kinds", "backend_options",
  "same_text_on_repeat", "stream_equals_unary", "items", "server_aborted", "server_attempts"]);
const ITEM_KEYS: ReadonlySet<string> = new Set([...CHECKED_KEYS, "ok"]);

const unknownKeys = (expect: Record<string, unknown>, known: ReadonlySet<string>, where = ""): string[] =>
  Object.keys(expect)
    .filter((k) => !known.has(k))
    .sort()
    .map((k) => `${where}unknown expect key ${JSON.stringify(k)}`);

/**
 * A probe model's count (scripted, answer_cancellations_of or answer_calls_of): how many
 * generations the server has abandoned, or calls received, on the model it watches.
 */
async function probeCount(client: GengateClient, probe: string): Promise<number> {
  let text: string | undefined;
  try {
    text = (await client.generate({ model: probe, input: { case: "prompt", value: "count" } })).generations[0]?.text;
  } catch (e) {
    throw new Error(`probe ${probe}: ${GengateError.from(e).message}`);
  }
  if (text === undefined) throw new Error(`probe ${probe} answered no generation`);
  if (!/^\d+$/.test(text.trim())) throw new Error(`probe ${probe} answered ${JSON.stringify(text)}, not a count`);
  return Number.parseInt(text.trim(), 10);
}

/** Polls the probe every 50 ms until the abandoned count passes `before`, for at most 10 s; the failure, if any. */
async function awaitAbort(client: GengateClient, probe: string, before: number): Promise<string | undefined> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    let n: number;
    try {
      n = await probeCount(client, probe);
    } catch (e) {
      return e instanceof Error ? e.message : String(e);
    }
    if (n > before) return undefined;
    if (Date.now() > deadline) return `the server did not abort the generation (abandoned count stayed ${n})`;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

const finishName = (r: FinishReason): string => `FINISH_REASON_${FinishReason[r]}`;
/**
 * A vector's protobuf-JSON request. A Magpie input is rebuilt with the client's typed helper
 * (`magpie()`), so the vector tests that path; one the helper cannot express exactly throws.
 */
function parse(raw: JsonValue | undefined): GenerateRequest {
  const request = withTypedTools(raw, fromJson(GenerateRequestSchema, raw ?? {}));
  if (request.input.case !== "magpie") return request;
  const m = request.input.value;
  const { $typeName: _, model, input: __, ...rest } = request;
  const typed = magpie(
    model,
    {
      template: m.preQuery.case === "preset" ? MagpiePreset[m.preQuery.value].toLowerCase() : (m.preQuery.value ?? ""),
      conversation: m.conversation,
      onlyInstruction: m.onlyInstruction,
      endWithUser: m.endWithUser,
      ...(m.systemPrompt !== undefined ? { systemPrompt: m.systemPrompt } : {}),
      ...(m.nTurns !== undefined ? { nTurns: m.nTurns } : {}),
    },
    rest,
  );
  if (typed.input.case !== "magpie" || !equals(MagpieSchema, typed.input.value, m) || !equals(GenerateRequestSchema, typed, request)) {
    throw new Error(`magpie() cannot express the vector's request ${JSON.stringify(raw)}`);
  }
  return typed;
}

/** A request with tools, rebuilt with the client's `withTools` (and its tool choices); one it cannot express exactly throws. */
function withTypedTools(raw: JsonValue | undefined, request: GenerateRequest): GenerateRequest {
  if (request.tools.length === 0) return request;
  const c = request.toolChoice?.choice;
  const choice: ToolChoiceOption | undefined =
    c?.case === "name" ? { name: c.value } : c?.case === "mode" ? (ToolChoiceMode[c.value].toLowerCase() as ToolChoiceOption) : undefined;
  const { $typeName: _, tools, toolChoice: __, parallelToolCalls, ...rest } = request;
  const typed = create(GenerateRequestSchema, {
    ...rest,
    ...withTools(tools, { ...(choice !== undefined ? { choice } : {}), ...(parallelToolCalls !== undefined ? { parallelToolCalls } : {}) }),
  });
  if (!equals(GenerateRequestSchema, typed, request)) throw new Error(`withTools() cannot express the vector's request ${JSON.stringify(raw)}`);
  return typed;
}

function fromError(e: unknown): Outcome {
  const err = GengateError.from(e);
  const out = { code: err.codeName, reason: err.reason, fields: err.fieldViolations.map((v) => v.field).sort() };
  retryDelays.set(out, err.retryDelayMs);
  return { error: out };
}

function fromResponse(resp: GenerateResponse): Outcome {
  const seed = resp.effectiveSampling?.seed;
  return {
    texts: resp.generations.map((g) => g.text),
    finishReasons: resp.generations.map((g) => finishName(g.finishReason)),
    outputTokens: resp.generations.map((g) => g.outputTokens),
    enforcement: `ENFORCEMENT_${Enforcement[resp.enforcement]}`,
    seed: seed === undefined ? undefined : String(seed),
    toolCalls: resp.generations.map((g) => g.toolCalls),
    ...conversationsOf(resp),
  };
}

function conversationsOf(resp: GenerateResponse): Pick<Outcome, "conversations"> {
  const conversations = resp.generations.map((g) =>
    conversation(g).map((t) => ({ role: `ROLE_${t.role.toUpperCase()}`, text: t.text, output_tokens: t.outputTokens })),
  );
  return conversations.some((turns) => turns.length > 0) ? { conversations } : {};
}

async function generate(client: GengateClient, raw: JsonValue | undefined, timeoutMs?: number): Promise<Outcome> {
  try {
    return fromResponse(await client.generate(parse(raw), timeoutMs === undefined ? {} : { timeoutMs }));
  } catch (e) {
    return fromError(e);
  }
}

/**
 * A structured request whose first generation goes through the typed path (parseGeneration, with
 * the request's own schema as zod): truncated is CLIENT_TRUNCATED_OUTPUT, bad CLIENT_OUTPUT_ERROR.
 */
async function generateObject(client: GengateClient, raw: JsonValue | undefined): Promise<Outcome> {
  const request = parse(raw);
  let response: GenerateResponse;
  try {
    response = await client.generate(request);
  } catch (e) {
    return fromError(e);
  }
  const so = request.structuredOutput?.kind;
  const schema = so?.case === "jsonSchema" ? z.fromJSONSchema(JSON.parse(so.value.schemaJson)) : z.unknown();
  try {
    parseGeneration(schema, response.generations[0]);
  } catch (e) {
    const code = e instanceof TruncatedOutputError ? "CLIENT_TRUNCATED_OUTPUT" : "CLIENT_OUTPUT_ERROR";
    return { error: { code, reason: "", fields: [] } };
  }
  return fromResponse(response);
}

async function stream(client: GengateClient, raw: JsonValue | undefined): Promise<Outcome> {
  const texts = new Map<number, string>();
  const ends = new Map<number, { finishReason: FinishReason; outputTokens: number }>();
  const kinds: [string, number][] = [];
  const calls = new StreamToolCalls();
  let fragments = 0;
  try {
    for await (const frame of client.generateStream(parse(raw))) {
      calls.add(frame);
      const f = frame.frame;
      if (f.case === "delta") fragments += f.value.toolCalls.length;
      if (f.case === "start") kinds.push(["start", -1]);
      else if (f.case === "delta") {
        kinds.push(["delta", f.value.index]);
        texts.set(f.value.index, (texts.get(f.value.index) ?? "") + f.value.text);
      } else if (f.case === "end") {
        kinds.push(["end", f.value.index]);
        ends.set(f.value.index, { finishReason: f.value.finishReason, outputTokens: f.value.usage?.outputTokens ?? 0 });
      }
    }
  } catch (e) {
    return fromError(e);
  }
  const indices = [...new Set([...texts.keys(), ...ends.keys()])].sort((a, b) => a - b);
  const ended = new Set<number>();
  let ordered = kinds[0]?.[0] === "start";
  for (const [kind, index] of kinds.slice(1)) {
    if (kind === "start" || ended.has(index)) ordered = false;
    if (kind === "end") ended.add(index);
  }
  return {
    texts: indices.map((i) => texts.get(i) ?? ""),
    finishReasons: indices.filter((i) => ends.has(i)).map((i) => finishName(ends.get(i)!.finishReason)),
    outputTokens: indices.filter((i) => ends.has(i)).map((i) => ends.get(i)!.outputTokens),
    framesOrdered: ordered && ended.size > 0,
    toolCalls: indices.map((i) => calls.final(i) ?? []),
    // Names and arguments: the end frame's ids are the final ones (the server makes those a backend left out).
    fragmentsMatchEnd:
      fragments > 0 &&
      indices.every((i) => {
        const final = (calls.final(i) ?? []).map((c) => [c.name, c.argumentsJson]);
        return JSON.stringify(calls.partial(i).map((c) => [c.name, c.argumentsJson])) === JSON.stringify(final);
      }),
  };
}

/**
 * Sends the vector's request, answers its first generation's calls with `results` through the
 * client's `withToolResults`, and sends the conversation on: the outcome is the second call's.
 */
async function toolRoundTrip(client: GengateClient, raw: JsonValue | undefined, results: Record<string, string>): Promise<Outcome> {
  try {
    const request = parse(raw);
    const first = (await client.generate(request)).generations[0];
    if (!first || first.toolCalls.length === 0) return { error: { code: "CLIENT_NO_TOOL_CALL", reason: "the first response made no tool call", fields: [] } };
    const given = request.input.case === "messages" ? request.input.value.messages : [];
    const messages = withToolResults(given, first, results);
    const { $typeName: _, ...fields } = request;
    return fromResponse(await client.generate({ ...fields, input: { case: "messages", value: { messages } } }));
  } catch (e) {
    return fromError(e);
  }
}

/** Generation i's calls against want ([{name, arguments}], arguments as JSON values); each needs an id, unique in the generation. */
function checkToolCalls(i: number, calls: ToolCall[], want: { name: string; arguments: unknown }[]): string[] {
  if (calls.length !== want.length) return [`generation ${i}: ${calls.length} tool calls ${JSON.stringify(observeCalls(calls))}, expected ${want.length}`];
  const failures: string[] = [];
  const ids = new Set<string>();
  for (const [k, call] of calls.entries()) {
    let args: unknown;
    try {
      args = JSON.parse(call.argumentsJson);
    } catch {
      failures.push(`generation ${i} call ${k}: arguments ${JSON.stringify(call.argumentsJson)} are not JSON`);
    }
    if (call.name !== want[k]!.name || !sameJson(args, want[k]!.arguments)) {
      failures.push(`generation ${i} call ${k}: ${call.name}(${call.argumentsJson}), expected ${want[k]!.name}(${JSON.stringify(want[k]!.arguments)})`);
    }
    if (call.id === "" || ids.has(call.id)) failures.push(`generation ${i} call ${k}: id ${JSON.stringify(call.id)} missing or repeated`);
    ids.add(call.id);
  }
  return failures;
}

/** Equal JSON values, object keys in any order (as Go and Python compare them). */
function sameJson(a: unknown, b: unknown): boolean {
  const canonical = (v: unknown): unknown =>
    Array.isArray(v)
      ? v.map(canonical)
      : v !== null && typeof v === "object"
        ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, canonical((v as Record<string, unknown>)[k])]))
        : v;
  return JSON.stringify(canonical(a)) === JSON.stringify(canonical(b));
}

const observeCalls = (calls: ToolCall[]) => calls.map((c) => ({ name: c.name, arguments_json: c.argumentsJson }));

/** Each generation's calls (name, arguments text), or undefined when none has any. */
const observeToolCalls = (perGeneration: ToolCall[][] | undefined) =>
  perGeneration?.some((calls) => calls.length > 0) ? perGeneration.map(observeCalls) : undefined;

async function cancelStream(client: GengateClient, raw: JsonValue | undefined, after: number): Promise<Outcome> {
  const controller = new AbortController();
  let deltas = 0;
  try {
    for await (const frame of client.generateStream(parse(raw), { signal: controller.signal })) {
      if (frame.frame.case === "delta" && ++deltas === after) controller.abort();
    }
    return { cancelled: false };
  } catch (e) {
    const err = GengateError.from(e);
    if (err.codeName !== "CANCELLED") return fromError(e);
    return { cancelled: deltas === after };
  }
}

function check(expect: Record<string, unknown>, out: Outcome, raw: JsonValue | undefined): string[] {
  const failures: string[] = [];
  const err = out.error;
  if (typeof expect["code"] === "string") {
    if (!err || err.code !== expect["code"]) return [`expected ${expect["code"]}, got ${JSON.stringify(err ?? "success")}`];
    if (typeof expect["reason"] === "string" && err.reason !== expect["reason"]) failures.push(`reason ${err.reason} != ${expect["reason"]}`);
    const field = expect["field_violation"];
    if (typeof field === "string" && !err.fields.includes(field)) failures.push(`no field violation ${field} in ${err.fields.join(",")}`);
    const retryAfter = expect["retry_after_s"];
    if (retryAfter !== undefined) {
      const delayMs = retryDelays.get(err);
      if (typeof retryAfter !== "number" || delayMs === undefined || delayMs / 1000 !== retryAfter) {
        failures.push(`retry delay ${delayMs === undefined ? "absent" : `${delayMs / 1000} s`} != ${JSON.stringify(retryAfter)} s`);
      }
    }
    return failures;
  }
  if ("retry_after_s" in expect) return ["retry_after_s is checked on an error only: the vector needs a code"];
  if (err) return [`unexpected error ${JSON.stringify(err)}`];
  const texts = out.texts ?? [];
  if (typeof expect["generations"] === "number" && texts.length !== expect["generations"]) {
    failures.push(`${texts.length} generations, expected ${expect["generations"]}`);
  }
  const maxTokens = expect["max_output_tokens"];
  if (typeof maxTokens === "number" && (out.outputTokens ?? []).some((t) => t > maxTokens)) {
    failures.push(`output_tokens ${out.outputTokens?.join(",")} over ${maxTokens}`);
  }
  const reasons = expect["finish_reasons"] as string[] | undefined;
  if (reasons && (out.finishReasons ?? []).some((r) => !reasons.includes(r))) {
    failures.push(`finish reasons ${out.finishReasons?.join(",")} not in ${reasons.join(",")}`);
  }
  if (typeof expect["seed_echoed"] === "string" && out.seed !== expect["seed_echoed"]) failures.push(`seed ${out.seed} != ${expect["seed_echoed"]}`);
  const enforcement = expect["enforcement"] as string[] | undefined;
  if (enforcement && !enforcement.includes(out.enforcement ?? "")) failures.push(`enforcement ${out.enforcement} not in ${enforcement.join(",")}`);
  if (expect["valid_json_schema"] === true) {
    const sent = (raw as { structuredOutput: { jsonSchema: { schema?: z.core.JSONSchema.JSONSchema; schemaJson?: string } } }).structuredOutput.jsonSchema;
    const schema = (sent.schemaJson !== undefined ? JSON.parse(sent.schemaJson) : sent.schema) as z.core.JSONSchema.JSONSchema;
    const validator = z.fromJSONSchema(schema);
    for (const text of texts) {
      let value: unknown;
      try {
        value = JSON.parse(text);
      } catch {
        failures.push(`${JSON.stringify(text)} is not JSON`);
        continue;
      }
      const result = validator.safeParse(value);
      if (!result.success) failures.push(`${JSON.stringify(text)} does not match the schema: ${result.error.message}`);
    }
  }
  if (typeof expect["full_match"] === "string") {
    const re = new RegExp(`^(?:${expect["full_match"]})$`, "u");
    for (const t of texts) if (!re.test(t)) failures.push(`${JSON.stringify(t)} does not match ${expect["full_match"]}`);
  }
  const choices = expect["one_of"] as string[] | undefined;
  if (choices) for (const t of texts) if (!choices.includes(t)) failures.push(`${JSON.stringify(t)} not one of ${choices.join(",")}`);
  if (expect["json_object"] === true) {
    for (const t of texts) {
      let value: unknown;
      try {
        value = JSON.parse(t);
      } catch {
        value = undefined;
      }
      if (typeof value !== "object" || value === null || Array.isArray(value)) failures.push(`${JSON.stringify(t)} is not a JSON object`);
    }
  }
  const keyOrder = expect["key_order"] as string[] | undefined;
  if (keyOrder) {
    for (const t of texts) {
      let keys: string[] = [];
      try {
        keys = Object.keys(JSON.parse(t) as object);
      } catch {
        keys = [];
      }
      if (!same(keys, keyOrder)) failures.push(`${JSON.stringify(t)}: keys ${keys.join(",")}, expected in order ${keyOrder.join(",")}`);
    }
  }
  if (expect["frames_ordered"] === true && !out.framesOrdered) failures.push("frames out of order");
  if (expect["cancelled"] === true && !out.cancelled) failures.push("the stream was not cancelled");
  const wantCalls = expect["tool_calls"] as { name: string; arguments: unknown }[] | undefined;
  if (wantCalls) {
    const calls = out.toolCalls ?? [];
    if (calls.length !== texts.length) failures.push(`tool calls of ${calls.length} generations, expected ${texts.length}`);
    for (const [i, generationCalls] of calls.entries()) failures.push(...checkToolCalls(i, generationCalls, wantCalls));
  }
  if (expect["tool_fragments_match_end"] === true && !out.fragmentsMatchEnd) failures.push("the tool-call fragments do not assemble into the end frames' calls");
  const roles = expect["conversation_roles"] as string[] | undefined;
  if (roles) {
    const conversations = out.conversations ?? [];
    if (conversations.length !== texts.length) failures.push(`no conversation in ${texts.length} generations`);
    for (const [i, turns] of conversations.entries()) {
      const got = turns.map((t) => t.role);
      if (!same(got, roles)) failures.push(`generation ${i}: roles ${got.join(",")}, expected ${roles.join(",")}`);
    }
  }
  return failures;
}

function observe(out: Outcome): Record<string, unknown> {
  if (out.error) return { error: out.error };
  const toolCalls = observeToolCalls(out.toolCalls);
  return { texts: out.texts ?? [], ...(out.conversations ? { conversations: out.conversations } : {}), ...(toolCalls ? { tool_calls: toolCalls } : {}) };
}
const same = (a: string[] | undefined, b: string[] | undefined): boolean => JSON.stringify(a) === JSON.stringify(b);

async function runVector(client: GengateClient, v: Vector): Promise<{ name: string; ok: boolean; failures: string[]; observed: Record<string, unknown> }> {
  const expect = v.expect;
  const failures: string[] = unknownKeys(expect, VECTOR_KEYS);
  for (const [i, item] of ((expect["items"] as Record<string, unknown>[] | undefined) ?? []).entries()) {
    failures.push(...unknownKeys(item, ITEM_KEYS, `item ${i}: `));
  }
  let observed: Record<string, unknown> = {};
  // server_aborted names a probe model: the server must abandon the call's generation.
  const probed = "server_aborted" in expect;
  const probe = expect["server_aborted"];
  let abandonedBefore = 0;
  if (probed) {
    if (typeof probe !== "string" || probe === "") {
      return { name: v.name, ok: false, failures: [`server_aborted must name a probe model, not ${JSON.stringify(probe)}`], observed };
    }
    try {
      abandonedBefore = await probeCount(client, probe);
    } catch (e) {
      return { name: v.name, ok: false, failures: [e instanceof Error ? e.message : String(e)], observed };
    }
  }
  // server_attempts is {probe, count}: the probe's call count must grow by count (the client's
  // attempts, retries included).
  let attempts: { probe: string; count: number; before: number } | undefined;
  if ("server_attempts" in expect) {
    const spec = expect["server_attempts"] as Record<string, unknown> | null;
    const probeName = spec?.["probe"];
    const count = spec?.["count"];
    if (typeof probeName !== "string" || probeName === "" || typeof count !== "number" || Object.keys(spec ?? {}).length !== 2) {
      return { name: v.name, ok: false, failures: [`server_attempts must be {probe, count}, not ${JSON.stringify(spec)}`], observed };
    }
    try {
      attempts = { probe: probeName, count, before: await probeCount(client, probeName) };
    } catch (e) {
      return { name: v.name, ok: false, failures: [e instanceof Error ? e.message : String(e)], observed };
    }
  }
  switch (v.call) {
    case "list_models": {
      const models = await client.listModels();
      const names = models.map((m) => m.name).sort();
      observed = { models: names };
      const found = models.find((m) => m.name === expect["model_listed"]);
      if (!found) {
        failures.push(`${expect["model_listed"]} not in ${names.join(",")}`);
        break;
      }
      const kinds = new Set((found.capabilities?.constraints ?? []).map((c) => `CONSTRAINT_KIND_${ConstraintKind[c.kind]}`));
      for (const k of (expect["constraint_kinds"] as string[] | undefined) ?? []) if (!kinds.has(k)) failures.push(`${k} not supported`);
      const options = [...(found.capabilities?.backendOptions ?? [])];
      observed.backend_options = options;
      const wantOptions = expect["backend_options"] as string[] | undefined;
      if (wantOptions && options.join(",") !== wantOptions.join(",")) {
        failures.push(`backend options ${options.join(",")}, want ${wantOptions.join(",")}`);
      }
      break;
    }
    case "generate_object": {
      const out = await generateObject(client, v.request);
      failures.push(...check(expect, out, v.request));
      observed = observe(out);
      break;
    }
    case "generate": {
      const out = await generate(client, v.request, v.timeout_ms);
      failures.push(...check(expect, out, v.request));
      if (expect["same_text_on_repeat"] === true) {
        for (let i = 1; i < (v.repeat ?? 2); i++) {
          const again = await generate(client, v.request);
          if (!same(again.texts, out.texts)) failures.push(`repeat gave ${JSON.stringify(again.texts)}, first ${JSON.stringify(out.texts)}`);
        }
      }
      observed = observe(out);
      // The client or the server may end it first: compare the code only.
      if (v.timeout_ms !== undefined && out.error) observed = { code: out.error.code };
      break;
    }
    case "stream": {
      const out = await stream(client, v.request);
      failures.push(...check(expect, out, v.request));
      if (expect["stream_equals_unary"] === true && !out.error) {
        const unary = await generate(client, v.request);
        if (!same(unary.texts, out.texts)) failures.push(`stream texts ${JSON.stringify(out.texts)} != unary ${JSON.stringify(unary.texts)}`);
        const [streamed, unaryCalls] = [JSON.stringify(observeToolCalls(out.toolCalls)), JSON.stringify(observeToolCalls(unary.toolCalls))];
        if (streamed !== unaryCalls) failures.push(`stream tool calls ${streamed} != unary ${unaryCalls}`);
      }
      observed = observe(out);
      break;
    }
    case "tool_round_trip": {
      const out = await toolRoundTrip(client, v.request, v.tool_results ?? {});
      failures.push(...check(expect, out, v.request));
      observed = observe(out);
      break;
    }
    case "cancel_stream": {
      const out = await cancelStream(client, v.request, v.cancel_after_deltas ?? 1);
      failures.push(...check(expect, out, v.request));
      const after = await generate(client, { model: "tiny", prompt: "still there?", stopping: { maxTokens: 2 } });
      if (after.error) failures.push(`server unhealthy after cancel: ${JSON.stringify(after.error)}`);
      observed = { cancelled: out.cancelled ?? null };
      break;
    }
    case "batch": {
      const requests = v.requests ?? [];
      const items = new Map<number, Outcome>();
      for await (const item of client.batchGenerate(requests.map(parse))) {
        items.set(item.index, item.error ? { error: fromError(item.error).error! } : fromResponse(item.response));
      }
      const obs: unknown[] = [];
      for (const [i, want] of ((expect["items"] as Record<string, unknown>[]) ?? []).entries()) {
        const got = items.get(i);
        if (!got) {
          failures.push(`item ${i} missing`);
          continue;
        }
        const sub = Object.fromEntries(Object.entries(want).filter(([k]) => k !== "ok"));
        failures.push(...check(sub, got, requests[i]).map((f) => `item ${i}: ${f}`));
        obs.push(got.error ?? observe(got));
      }
      observed = { items: obs };
      break;
    }
    default:
      failures.push(`unknown call ${v.call}`);
  }
  if (typeof probe === "string") {
    const failure = await awaitAbort(client, probe, abandonedBefore);
    if (failure !== undefined) failures.push(failure);
    observed.server_aborted = failure === undefined;
  }
  if (attempts) {
    try {
      const made = (await probeCount(client, attempts.probe)) - attempts.before;
      observed.server_attempts = made;
      if (made !== attempts.count) failures.push(`${made} attempts reached the server, expected ${attempts.count}`);
    } catch (e) {
      failures.push(e instanceof Error ? e.message : String(e));
    }
  }
  return { name: v.name, ok: failures.length === 0, failures, observed };
}

/** Runs `v` with the shared client, or with a client made for it alone when it sets client options. */
async function runWithItsClient(shared: GengateClient, address: string, v: Vector): ReturnType<typeof runVector> {
  if (v.client === undefined) return runVector(shared, v);
  const unknown = Object.entries(v.client).filter(([key, value]) => key !== "max_retries" || typeof value !== "number");
  if (unknown.length > 0) {
    return { name: v.name, ok: false, failures: unknown.map(([k, val]) => `unknown client option ${k}: ${JSON.stringify(val)}`), observed: {} };
  }
  // a connect client holds no connection of its own to close: the transport's sessions idle out
  const own = new GengateClient({ address, timeoutMs: 120_000, maxRetries: v.client["max_retries"] as number });
  return runVector(own, v);
}

async function main(): Promise<void> {
  const [address, path] = process.argv.slice(2);
  if (!address || !path) throw new Error("usage: runner.ts ADDRESS VECTORS");
  const vectors = (JSON.parse(readFileSync(path, "utf8")) as { vectors: Vector[] }).vectors;
  const client = new GengateClient({ address, timeoutMs: 120_000 });
  const results = [];
  for (const v of vectors) {
    try {
      results.push(await runWithItsClient(client, address, v));
    } catch (e) {
      results.push({ name: v.name, ok: false, failures: [String(e)], observed: {} });
    }
  }
  process.stdout.write(JSON.stringify({ language: "typescript", results }, null, 1) + "\n");
  process.exit(0);
}

await main();
