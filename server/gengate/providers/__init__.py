"""Remote providers behind the one backend protocol: one module per provider, one shared base.

How to write a provider (see openai.py for a complete one):

1. Options: subclass `base.ProviderOptions` (pydantic, extra="forbid"; already has model,
   base_url, api_key_env | api_key (SecretStr), timeout, max_retries, validation_retries,
   validation, max_n, context_length). Add only your provider's keys.
2. Backend: subclass `base.ProviderBackend` and set the class variables: `kind` (registry
   name), `Options`, `label` (human name for errors/logs), `structured_support`
   ({ConstraintKind: Enforcement.NATIVE | VALIDATED}; kinds absent are refused up front),
   `grammar_syntaxes`, `native_n`, `logprobs_supported`, `max_top_logprobs`, `image_input`,
   `seed_supported`, `requires_api_key`, and for tools and reasoning `tools_support`
   (Enforcement.NATIVE once the provider's tools are mapped; None refuses them up front),
   `reasoning_controls` (takes `request.reasoning`; override `check_reasoning` to refuse the
   knobs it lacks) and `reasoning_output` (returns the thinking). `self.api_key` is resolved
   and registered for redaction (gengate.redaction) in `__init__`; build your SDK client in
   `start()` (call `super().start()` first) with the SDK's own retries OFF (max_retries=0)
   and `timeout=self.options.timeout`.
3. Write only the wire translation:
   - `async _complete(call) -> Completion`: ONE upstream call for `call.n` choices of
     `call.messages` (domain ChatMessages; constraint instructions for VALIDATED kinds are
     already in the system message), honouring `call.timeout`. Return `Generation`s (text,
     finish reason via `base.map_finish_reason`, logprobs, `tool_calls` as made, ids may be
     empty, and `reasoning`) and `Usage` or None if absent. Send `request.tools`,
     `tool_choice`, `parallel_tool_calls` and tool turns (`ChatMessage.tool_calls`,
     `Role.TOOL` with `tool_call_id`) in the provider's own shape.
   - `_stream(call) -> AsyncIterator[Chunk]`: an async generator yielding `ChunkText` (text,
     `ToolCallDelta` fragments, reasoning text), `ChunkEnd` and (once) `ChunkUsage` (totals);
     close the SDK stream in `finally` so a cancelled consumer closes the HTTP response.
     An SDK that types every answer and chunk (openai, anthropic, cohere) can instead send
     through its client and hand back the raw response: `providers.rawhttp` reads the body and
     the SSE events bounded, and its accessors read fields of dicts and SDK objects alike.
     Structured requests never reach it. A stream that ends without any chunk, or without a
     `ChunkEnd` (its finish marker), is a broken upstream: the base raises Unavailable
     UPSTREAM_PROTOCOL.
   - If `call.plan` is native (`call.plan.native`), send `call.plan.native_schema` (a JSON
     Schema; choices arrive as {"type":"string","enum":[...]}) or, for regex/grammar/choice on
     engines that take them, `call.plan.structured.constraint`. Override `plan_structured` to
     transform schemas (see `structured.plan_openai_style(..., strict_transform=True)`).
   - Just raise the SDK's exceptions: the base maps them by meaning with
     `errors.normalize_exception` (429 → ResourceExhausted + retry_after_s, 5xx/connection →
     Unavailable, timeout → DeadlineExceeded, 401/403 → Internal UPSTREAM_AUTH_FAILED, 400 →
     InvalidArgument, all messages scrubbed of secrets). Override `normalize_error` only for
     provider quirks (call `errors.from_status(status, body, headers=..., provider=...)`).
4. The base does the rest: retries with backoff + jitter honouring Retry-After and the
   deadline (streams: only before the first chunk), `n` fan-out when fewer choices return,
   validation of every structured result against the ORIGINAL constraint with bounded re-asks
   (Aborted VALIDATION_FAILED when it stays invalid), the same for every tool call (checked
   by `gengate.tools.ToolSet`, ids made where missing, a forced tool's `stop` read as
   TOOL_CALLS; a streamed call is assembled for the end frame and, invalid, ends the stream
   with the same error, since a sent delta cannot be re-asked), usage in every stream end frame
   (estimated with `base.estimate_tokens` only when the provider sends none).
5. Add one `KindSpec` row to `gengate.registry.KINDS`: the class path, the pip extra (and the
   SDK module to find), the GenAI provider name for spans, the standard key variables (read when
   the config names no key), and a `default_model` if it should register with no config file
   once its key variable is set. Tests: a loopback fake server speaking the wire protocol,
   driven through the real SDK (see tests/providers/ and CONTRIBUTING.md).
"""
