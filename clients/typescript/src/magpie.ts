/** Magpie requests (the model writes the user turns itself) and the conversations they return. */
import { create, type MessageInitShape } from "@bufbuild/protobuf";

import type { GenerateRequestInit } from "./client.js";
import { GenerateRequestSchema, type GenerateRequest } from "./gen/gengate/v1/generation_pb.js";
import {
  MagpiePreset,
  Role,
  type ChatMessageSchema,
  type Generation,
  type MagpieSchema,
} from "./gen/gengate/v1/types_pb.js";

/** The chat formats whose pre-query text the server knows, by the name `MagpieOptions.template` takes. */
export const MAGPIE_PRESETS = ["llama3", "qwen2", "phi3", "gemma"] as const;
export type MagpiePresetName = (typeof MAGPIE_PRESETS)[number];

/** A chat role by name, as the Python client spells it. */
export type RoleName = "system" | "user" | "assistant";

/** A turn already written: `{ role: "user", content: "Hi" }`, or a ChatMessage (init or message). */
export type MagpieMessage = { role: RoleName; content: string } | MessageInitShape<typeof ChatMessageSchema>;

export type MagpieInit = MessageInitShape<typeof MagpieSchema>;

/** What a Magpie request asks; only `template` is required. */
export interface MagpieOptions {
  /**
   * A preset name, "llama3", "qwen2", "phi3" or "gemma" (that chat format's pre-query text), or any
   * other text: a custom pre-query text sent exactly as given, as the Python client's `Magpie`
   * does. No name is refused here: a misspelt preset goes as a template.
   */
  template: MagpiePresetName | (string & {});
  /** Steers the instructions toward a topic or style. */
  systemPrompt?: string;
  /** Turns already written (user and assistant): the next user turn follows them. */
  conversation?: MagpieMessage[];
  /** User turns to write, each followed by the model's answer (server default 1, at most 16). */
  nTurns?: number;
  /** Write the first user turn only: no answer, `nTurns` ignored. */
  onlyInstruction?: boolean;
  /** End on a user turn: the last one gets no answer. */
  endWithUser?: boolean;
}

/** One turn of a Magpie conversation; `outputTokens`: generated for it (0 for given turns). */
export interface Turn {
  role: RoleName;
  text: string;
  outputTokens: number;
}

const PRESETS: Record<MagpiePresetName, MagpiePreset> = {
  llama3: MagpiePreset.LLAMA3,
  qwen2: MagpiePreset.QWEN2,
  phi3: MagpiePreset.PHI3,
  gemma: MagpiePreset.GEMMA,
};
const ROLES: Record<RoleName, Role> = { system: Role.SYSTEM, user: Role.USER, assistant: Role.ASSISTANT };
const ROLE_NAMES = new Map<Role, RoleName>(Object.entries(ROLES).map(([name, role]) => [role, name as RoleName]));

const isPreset = (template: string): template is MagpiePresetName => Object.hasOwn(PRESETS, template);

function chatMessage(message: MagpieMessage): MessageInitShape<typeof ChatMessageSchema> {
  if (typeof message.role !== "string") return message as MessageInitShape<typeof ChatMessageSchema>;
  const { role, content } = message as { role: string; content: string };
  if (!Object.hasOwn(ROLES, role)) {
    throw new TypeError(`unknown role ${JSON.stringify(role)}; expected one of ${Object.keys(ROLES).sort().join(", ")}`);
  }
  return { role: ROLES[role as RoleName], content: [{ part: { case: "text", value: content } }] };
}

/** The gengate.v1 Magpie input: a preset name becomes the preset, any other text the template. */
export function magpieInput(options: MagpieOptions): MagpieInit {
  const { template } = options;
  return {
    preQuery: isPreset(template) ? { case: "preset", value: PRESETS[template] } : { case: "template", value: template },
    conversation: (options.conversation ?? []).map(chatMessage),
    onlyInstruction: options.onlyInstruction ?? false,
    endWithUser: options.endWithUser ?? false,
    ...(options.systemPrompt !== undefined ? { systemPrompt: options.systemPrompt } : {}),
    ...(options.nTurns !== undefined ? { nTurns: options.nTurns } : {}),
  };
}

/**
 * A Magpie request: the model writes the user turns itself. `rest` holds the other request fields
 * (`sampling`, `stopping`, `n`, ...), which apply to every turn.
 */
export function magpie(
  model: string,
  options: MagpieOptions,
  rest: Omit<Exclude<GenerateRequestInit, GenerateRequest>, "model" | "input"> = {},
): GenerateRequest {
  return create(GenerateRequestSchema, { ...rest, model, input: { case: "magpie", value: magpieInput(options) } });
}

/**
 * A Magpie generation's turns, oldest first: the given conversation, then the written turns (the
 * generation's text is the last one). Empty for other requests.
 */
export function conversation(generation: Generation | undefined): Turn[] {
  return (generation?.conversation ?? []).map((t) => ({
    role: ROLE_NAMES.get(t.role) ?? "user",
    text: t.text,
    outputTokens: t.outputTokens,
  }));
}
