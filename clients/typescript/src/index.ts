/** @gengate/client: typed TypeScript client for gengate. */
export {
  GengateClient,
  createGengateClient,
  prompt,
  type BatchItem,
  type CallOptions,
  type ClientOptions,
  type GenerateRequestInit,
  type ObjectResult,
  type TlsOptions,
} from "./client.js";
export {
  BatchJobs,
  UPLOAD_ABOVE,
  type CreateJobOptions,
  type ListJobsOptions,
  type ResultsOptions,
} from "./jobs.js";
export {
  MAGPIE_PRESETS,
  conversation,
  magpie,
  magpieInput,
  type MagpieInit,
  type MagpieMessage,
  type MagpieOptions,
  type MagpiePresetName,
  type RoleName,
  type Turn,
} from "./magpie.js";
export { Code, GengateError, InvalidOutputError, TruncatedOutputError, type FieldViolation } from "./errors.js";
export {
  choice,
  jsonObject,
  jsonSchema,
  larkGrammar,
  parseGeneration,
  parseWithZod,
  regex,
  schemaFromZod,
  type StructuredOutputInit,
} from "./structured.js";
export {
  StreamToolCalls,
  assistantMessage,
  parseToolCalls,
  tool,
  toolChoice,
  toolMessage,
  withToolResults,
  withTools,
  type ChatMessageInit,
  type ParsedToolCall,
  type ToolChoiceInit,
  type ToolChoiceOption,
  type ToolInit,
  type ToolOptions,
  type ToolSpec,
  type ZodTool,
} from "./tools.js";
export { tracingInterceptor, type TracingOptions } from "./tracing.js";
export { DEFAULT_RETRY_POLICY, MAX_RETRIES_LIMIT, retryInterceptor, retryPolicy, type RetryPolicy } from "./retry.js";
export * from "./gen/gengate/v1/generation_pb.js";
export * from "./gen/gengate/v1/types_pb.js";
export * from "./gen/gengate/v1/jobs_pb.js";
export { VERSION } from "./version.js";
