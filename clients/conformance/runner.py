"""Python conformance runner: runs vectors.json with the gengate_client package.

    python runner.py ADDRESS [VECTORS]   prints {"language": "python", "results": [...]} as JSON

Each result is {name, ok, failures, observed}; `observed` must match the other languages'.

Tool calling goes through the client's tool API like everything else: tools and tool choice as
`generate()` options, calls read from the typed generations and stream frames, and the round trip
continued with `gengate_client.tools.with_results`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
from gengate_client import (
    Choice,
    Client,
    GengateError,
    Grammar,
    JsonObject,
    JsonSchema,
    Magpie,
    OutputError,
    Regex,
    StreamDelta,
    StreamStart,
    Tool,
    TruncatedOutputError,
    Turn,
)
from gengate_client.tools import with_results
from gengate_proto.v1 import generation_pb2, types_pb2
from google.protobuf import json_format

Outcome = dict[str, Any]


def _kwargs(request: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """The client's generate() arguments for a protobuf-JSON GenerateRequest."""
    pb = json_format.ParseDict(request, generation_pb2.GenerateRequest())
    options: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if pb.sampling.HasField(name):
            options[name] = getattr(pb.sampling, name)
    if pb.stopping.HasField("max_tokens"):
        options["max_tokens"] = pb.stopping.max_tokens
    if pb.stopping.stop:
        options["stop"] = list(pb.stopping.stop)
    if pb.HasField("n"):
        options["n"] = pb.n
    if pb.HasField("messages"):
        options["messages"] = list(pb.messages.messages)
    if pb.HasField("magpie"):
        options["magpie"] = _magpie(pb.magpie)
    if pb.tools:
        options["tools"] = [
            Tool(
                t.name,
                t.description,
                json.loads(t.parameters_json) if t.parameters_json else None,
                strict=t.strict,
            )
            for t in pb.tools
        ]
    if pb.HasField("tool_choice"):
        choice = pb.tool_choice
        if choice.WhichOneof("choice") == "name":
            options["tool_choice"] = choice.name
        else:
            mode = types_pb2.ToolChoiceMode.Name(choice.mode)
            options["tool_choice"] = mode.removeprefix("TOOL_CHOICE_MODE_").lower()
    if pb.HasField("parallel_tool_calls"):
        options["parallel_tool_calls"] = pb.parallel_tool_calls
    so = pb.structured_output
    kind = so.WhichOneof("kind")
    if kind == "json_schema":
        sent = so.json_schema
        schema = json.loads(sent.schema_json) if sent.schema_json else json_format.MessageToDict(sent.schema)
        options["output_type"] = JsonSchema(schema, sent.name)
    elif kind == "regex":
        options["output_type"] = Regex(so.regex.pattern)
    elif kind == "choice":
        options["output_type"] = Choice(list(so.choice.choices))
    elif kind == "grammar":
        syntax = types_pb2.GrammarSyntax.Name(so.grammar.syntax).removeprefix("GRAMMAR_SYNTAX_").lower()
        options["output_type"] = Grammar(so.grammar.definition, syntax)  # type: ignore[arg-type]
    elif kind == "json_object":
        options["output_type"] = JsonObject()
    prompt = pb.prompt if pb.HasField("prompt") else None
    return pb.model, prompt, options


def _magpie(pb: types_pb2.Magpie) -> Magpie:
    """The client's typed Magpie for a proto one: a preset by its name, else the template."""
    if pb.WhichOneof("pre_query") == "preset":
        template = types_pb2.MagpiePreset.Name(pb.preset).removeprefix("MAGPIE_PRESET_").lower()
    else:
        template = pb.template
    return Magpie(
        template,
        system_prompt=pb.system_prompt if pb.HasField("system_prompt") else None,
        conversation=list(pb.conversation),
        n_turns=pb.n_turns if pb.HasField("n_turns") else None,
        only_instruction=pb.only_instruction,
        end_with_user=pb.end_with_user,
    )


def _error(exc: GengateError) -> Outcome:
    return {
        "error": {
            "code": exc.code_name,
            "reason": exc.reason or "",
            "fields": sorted(v.field for v in exc.field_violations),
        },
        "retry_after_s": exc.retry_after,
    }


def _response(resp: Any) -> Outcome:
    raw = resp.raw
    out = {
        "texts": [g.text for g in raw.generations],
        "finish_reasons": [types_pb2.FinishReason.Name(g.finish_reason) for g in raw.generations],
        "output_tokens": [g.output_tokens for g in raw.generations],
        "enforcement": types_pb2.Enforcement.Name(raw.enforcement),
        "seed": str(raw.effective_sampling.seed) if raw.effective_sampling.HasField("seed") else None,
    }
    # Magpie turns from the typed Generation.conversation (Turn), roles by their proto names.
    conversations = [[_turn(t) for t in g.conversation] for g in resp.generations]
    if any(conversations):
        out["conversations"] = conversations
    out["tool_calls"] = [_calls(g.tool_calls) for g in resp.generations]
    return out


def _calls(calls: Any) -> list[dict[str, str]]:
    """Tool calls as the runners compare them (ids checked, not observed: the server makes some)."""
    return [{"id": c.id, "name": c.name, "arguments_json": c.arguments_json} for c in calls]


def _tool_round_trip(client: Client, request: dict[str, Any], results: dict[str, str]) -> Outcome:
    """Sends `request`, answers its first generation's calls with `results` (call id -> result)
    through `with_results`, and sends the conversation on."""
    model, prompt, options = _kwargs(request)
    try:
        first = client.generate(model, prompt, **options)
        if not first.generations or not first.generations[0].tool_calls:
            return {"error": {"code": "CLIENT_NO_TOOL_CALL", "reason": "no tool call", "fields": []}}
        try:
            options["messages"] = with_results(options.get("messages", []), first.generations[0], results)
        except ValueError as exc:
            return {"error": {"code": "CLIENT_ERROR", "reason": str(exc), "fields": []}}
        return _response(client.generate(model, None, **options))
    except GengateError as exc:
        return _error(exc)


def _turn(turn: Turn) -> dict[str, Any]:
    return {"role": f"ROLE_{turn.role.upper()}", "text": turn.text, "output_tokens": turn.output_tokens}


def _observe(out: Outcome) -> Outcome:
    """What every runner must agree on: the error, or the texts (and Magpie conversations)."""
    if "error" in out:
        return {"error": out["error"]}
    observed = {"texts": out["texts"]}
    if "conversations" in out:
        observed["conversations"] = out["conversations"]
    calls = _observed_calls(out)
    if calls is not None:
        observed["tool_calls"] = calls
    return observed


def _observed_calls(out: Outcome) -> list[list[dict[str, str]]] | None:
    """Each generation's calls (name, arguments text), or None when none has any."""
    per_generation = out.get("tool_calls", [])
    if not any(per_generation):
        return None
    return [
        [{"name": c["name"], "arguments_json": c["arguments_json"]} for c in calls]
        for calls in per_generation
    ]


def generate(client: Client, request: dict[str, Any], timeout_ms: int | None = None) -> Outcome:
    model, prompt, options = _kwargs(request)
    if timeout_ms is not None:
        options["timeout"] = timeout_ms / 1000
    try:
        return _response(client.generate(model, prompt, **options))
    except GengateError as exc:
        return _error(exc)
    except TruncatedOutputError:  # before OutputError, its base
        return {"error": {"code": "CLIENT_TRUNCATED_OUTPUT", "reason": "", "fields": []}}
    except OutputError as exc:
        return {"error": {"code": "CLIENT_OUTPUT_ERROR", "reason": str(exc), "fields": []}}


def stream(client: Client, request: dict[str, Any]) -> Outcome:
    model, prompt, options = _kwargs(request)
    kinds: list[tuple[str, int]] = []
    texts: dict[int, str] = {}
    ends: dict[int, Any] = {}
    partial: dict[int, list[dict[str, str]]] = {}
    fragments = 0
    try:
        for frame in client.generate_stream(model, prompt, **options):
            if isinstance(frame, StreamStart):
                kinds.append(("start", -1))
            elif isinstance(frame, StreamDelta):
                kinds.append(("delta", frame.index))
                texts[frame.index] = texts.get(frame.index, "") + frame.text
                calls = partial.setdefault(frame.index, [])
                for f in frame.tool_calls:
                    fragments += 1
                    while len(calls) <= f.index:
                        calls.append({"id": "", "name": "", "arguments_json": ""})
                    calls[f.index]["id"] = f.id or calls[f.index]["id"]
                    calls[f.index]["name"] = f.name or calls[f.index]["name"]
                    calls[f.index]["arguments_json"] += f.arguments_fragment
            else:
                kinds.append(("end", frame.index))
                ends[frame.index] = frame
    except GengateError as exc:
        return _error(exc)
    indices = sorted(set(texts) | set(ends))
    final = {i: _calls(ends[i].tool_calls) if i in ends else [] for i in indices}

    def named(calls: list[dict[str, str]]) -> list[tuple[str, str]]:
        return [(c["name"], c["arguments_json"]) for c in calls]

    return {
        "texts": [texts.get(i, "") for i in indices],
        "finish_reasons": [
            types_pb2.FinishReason.Name(ends[i].raw.finish_reason) for i in indices if i in ends
        ],
        "output_tokens": [ends[i].raw.usage.output_tokens for i in indices if i in ends],
        "frames_ordered": _ordered(kinds),
        "tool_calls": [final[i] for i in indices],
        # Names and arguments: the end frame's ids are the final ones (the server makes those a
        # backend left out).
        "fragments_match_end": fragments > 0
        and all(named(partial.get(i, [])) == named(final[i]) for i in indices),
    }


def _ordered(kinds: list[tuple[str, int]]) -> bool:
    """One start first; per index, deltas before exactly one end, nothing after it."""
    if not kinds or kinds[0][0] != "start" or any(k == "start" for k, _ in kinds[1:]):
        return False
    ended: set[int] = set()
    for kind, index in kinds[1:]:
        if index in ended:
            return False
        if kind == "end":
            ended.add(index)
    return len(ended) > 0


def cancel_stream(client: Client, request: dict[str, Any], after: int) -> Outcome:
    model, prompt, options = _kwargs(request)
    deltas, finished = 0, False
    try:
        for frame in client.generate_stream(model, prompt, **options):
            if type(frame).__name__ == "StreamDelta":
                deltas += 1
                if deltas == after:
                    break  # leaving the loop cancels the call
        else:
            finished = True
    except GengateError as exc:
        return _error(exc)
    return {"cancelled": deltas == after and not finished}


def check(expect: dict[str, Any], out: Outcome, request: dict[str, Any] | None) -> list[str]:
    """The expectation keys shared by every runner."""
    failures: list[str] = []
    err = out.get("error")
    if "code" in expect:
        if not err or err["code"] != expect["code"]:
            return [f"expected {expect['code']}, got {err or 'success'}"]
        if "reason" in expect and err["reason"] != expect["reason"]:
            failures.append(f"reason {err['reason']!r} != {expect['reason']!r}")
        if "field_violation" in expect and expect["field_violation"] not in err["fields"]:
            failures.append(f"no field violation {expect['field_violation']} in {err['fields']}")
        if "retry_after_s" in expect and out.get("retry_after_s") != expect["retry_after_s"]:
            failures.append(f"RetryInfo delay {out.get('retry_after_s')} s != {expect['retry_after_s']} s")
        return failures
    if err:
        return [f"unexpected error {err}"]
    texts = out.get("texts", [])
    if "generations" in expect and len(texts) != expect["generations"]:
        failures.append(f"{len(texts)} generations, expected {expect['generations']}")
    if "max_output_tokens" in expect and any(t > expect["max_output_tokens"] for t in out["output_tokens"]):
        failures.append(f"output_tokens {out['output_tokens']} over {expect['max_output_tokens']}")
    if "finish_reasons" in expect and any(r not in expect["finish_reasons"] for r in out["finish_reasons"]):
        failures.append(f"finish reasons {out['finish_reasons']} not in {expect['finish_reasons']}")
    if "seed_echoed" in expect and out.get("seed") != expect["seed_echoed"]:
        failures.append(f"seed {out.get('seed')} != {expect['seed_echoed']}")
    if "enforcement" in expect and out.get("enforcement") not in expect["enforcement"]:
        failures.append(f"enforcement {out.get('enforcement')} not in {expect['enforcement']}")
    if expect.get("valid_json_schema") and request is not None:
        sent = request["structuredOutput"]["jsonSchema"]
        schema = json.loads(sent["schemaJson"]) if "schemaJson" in sent else sent["schema"]
        for text in texts:
            try:
                jsonschema.Draft202012Validator(schema).validate(json.loads(text))
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{text!r} does not match the schema: {str(exc).splitlines()[0]}")
    if "full_match" in expect:
        failures += [
            f"{t!r} does not match {expect['full_match']}"
            for t in texts
            if not re.fullmatch(expect["full_match"], t)
        ]
    if "one_of" in expect:
        failures += [f"{t!r} not one of {expect['one_of']}" for t in texts if t not in expect["one_of"]]
    if expect.get("json_object"):
        for text in texts:
            try:
                if not isinstance(json.loads(text), dict):
                    failures.append(f"{text!r} is not an object")
            except ValueError:
                failures.append(f"{text!r} is not JSON")
    if "key_order" in expect:
        for text in texts:
            try:
                keys = list(json.loads(text))
            except ValueError:
                keys = []
            if keys != expect["key_order"]:
                failures.append(f"{text!r}: keys {keys}, expected in order {expect['key_order']}")
    if expect.get("frames_ordered") and not out.get("frames_ordered"):
        failures.append("frames out of order")
    if expect.get("cancelled") and not out.get("cancelled"):
        failures.append("the stream was not cancelled")
    if "tool_calls" in expect:
        per_generation = out.get("tool_calls", [[] for _ in texts])
        if len(per_generation) != len(texts):
            failures.append(f"tool calls of {len(per_generation)} generations, expected {len(texts)}")
        for i, calls in enumerate(per_generation):
            failures += _check_calls(i, calls, expect["tool_calls"])
    if expect.get("tool_fragments_match_end") and not out.get("fragments_match_end"):
        failures.append("the tool-call fragments do not assemble into the end frames' calls")
    if "conversation_roles" in expect:
        conversations = out.get("conversations", [])
        if len(conversations) != len(texts):
            failures.append(f"no conversation in {len(texts)} generations")
        for i, turns in enumerate(conversations):
            roles = [t["role"] for t in turns]
            if roles != expect["conversation_roles"]:
                failures.append(f"generation {i}: roles {roles}, expected {expect['conversation_roles']}")
    return failures


def _check_calls(i: int, calls: list[dict[str, str]], want: list[dict[str, Any]]) -> list[str]:
    """Generation i's calls against want ([{name, arguments}], arguments as JSON values); each call
    needs an id, unique in the generation."""
    if len(calls) != len(want):
        return [f"generation {i}: {len(calls)} tool calls {calls}, expected {len(want)}"]
    failures: list[str] = []
    ids: set[str] = set()
    for k, (call, w) in enumerate(zip(calls, want, strict=True)):
        try:
            arguments = json.loads(call["arguments_json"])
        except ValueError:
            failures.append(f"generation {i} call {k}: arguments {call['arguments_json']!r} are not JSON")
            arguments = None
        if call["name"] != w["name"] or arguments != w["arguments"]:
            failures.append(
                f"generation {i} call {k}: {call['name']}({call['arguments_json']}), expected {w}"
            )
        if not call["id"] or call["id"] in ids:
            failures.append(f"generation {i} call {k}: id {call['id']!r} missing or repeated")
        ids.add(call["id"])
    return failures


# Every `expect` key some runner checks: check()'s, then those run_vector reads itself. A key
# outside this set fails its vector, so a vector can never pass by being ignored.
CHECKED_KEYS = frozenset({
    "code", "reason", "field_violation", "generations", "max_output_tokens", "finish_reasons",
    "seed_echoed", "enforcement", "valid_json_schema", "full_match", "one_of", "json_object",
    "key_order", "frames_ordered", "cancelled", "retry_after_s", "conversation_roles",
    "tool_calls", "tool_fragments_match_end",
})  # fmt: skip
VECTOR_KEYS = CHECKED_KEYS | {
    "model_listed", "constraint_kinds", "backend_options", "same_text_on_repeat",
    "stream_equals_unary", "items", "server_aborted", "server_attempts",
}  # fmt: skip
ITEM_KEYS = CHECKED_KEYS | {"ok"}


def unknown_keys(expect: dict[str, Any], known: frozenset[str], where: str = "") -> list[str]:
    return [f'{where}unknown expect key "{key}"' for key in expect if key not in known]


def abandoned(client: Client, probe: str) -> int:
    """The count a probe model answers: generations the server abandoned, or calls a model received."""
    text = client.generate(probe, "count").generations[0].text
    return int(text.strip())


def await_abort(client: Client, probe: str, before: int) -> list[str]:
    """Waits (up to 10 s) for the probe's count to pass `before`: the server aborted."""
    count, give_up = before, time.monotonic() + 10
    while time.monotonic() < give_up:
        count = abandoned(client, probe)
        if count > before:
            return []
        time.sleep(0.05)
    return [f"the server did not abort the generation (abandoned count stayed {count})"]


def run_vector(client: Client, v: dict[str, Any]) -> dict[str, Any]:
    expect, call, request = v["expect"], v["call"], v.get("request")
    failures = unknown_keys(expect, VECTOR_KEYS)
    for i, item in enumerate(expect.get("items", [])):
        failures += unknown_keys(item, ITEM_KEYS, f"item {i}: ")
    observed: dict[str, Any] = {}
    probe = expect.get("server_aborted")
    before = abandoned(client, probe) if probe else 0
    attempts = expect.get("server_attempts")
    calls_before = abandoned(client, attempts["probe"]) if attempts else 0
    if call == "list_models":
        models = client.list_models()
        names = sorted(m.name for m in models)
        observed = {"models": names}
        tiny = next((m for m in models if m.name == expect["model_listed"]), None)
        if tiny is None:
            failures.append(f"{expect['model_listed']} not in {names}")
        else:
            kinds = {"CONSTRAINT_KIND_" + str(c.kind).upper() for c in tiny.capabilities.constraints}
            failures += [f"{k} not supported" for k in expect.get("constraint_kinds", []) if k not in kinds]
            options = list(tiny.capabilities.backend_options)
            observed["backend_options"] = options
            if "backend_options" in expect and options != expect["backend_options"]:
                failures.append(f"backend options {options}, want {expect['backend_options']}")
    elif call == "generate":
        out = generate(client, request, v.get("timeout_ms"))
        failures += check(expect, out, request)
        if expect.get("same_text_on_repeat"):
            again = [generate(client, request).get("texts") for _ in range(v.get("repeat", 2) - 1)]
            failures += [f"repeat gave {t}, first {out.get('texts')}" for t in again if t != out.get("texts")]
        observed = _observe(out)
        if "timeout_ms" in v and "error" in out:  # client or server may end it first: code only
            observed = {"code": out["error"]["code"]}
    elif call == "generate_object":  # this client's generate is typed already (output_type)
        out = generate(client, request)
        failures += check(expect, out, request)
        observed = _observe(out)
    elif call == "stream":
        out = stream(client, request)
        failures += check(expect, out, request)
        if expect.get("stream_equals_unary") and "error" not in out:
            unary = generate(client, request)
            if unary.get("texts") != out["texts"]:
                failures.append(f"stream texts {out['texts']} != unary {unary.get('texts')}")
            if _observed_calls(unary) != _observed_calls(out):
                failures.append(f"stream tool calls {_observed_calls(out)} != unary {_observed_calls(unary)}")
        observed = _observe(out)
    elif call == "tool_round_trip":
        out = _tool_round_trip(client, request, v.get("tool_results", {}))
        failures += check(expect, out, request)
        observed = _observe(out)
    elif call == "cancel_stream":
        out = cancel_stream(client, request, v["cancel_after_deltas"])
        failures += check(expect, out, request)
        after = generate(client, {"model": "tiny", "prompt": "still there?", "stopping": {"maxTokens": 2}})
        if "error" in after:
            failures.append(f"server unhealthy after cancel: {after['error']}")
        observed = {"cancelled": out.get("cancelled")}
    elif call == "batch":
        items: dict[int, Outcome] = {}
        for item in client.batch_generate_iter([_batch_request(r) for r in v["requests"]]):
            if item.error is not None:
                items[item.index] = (
                    _error(item.error)
                    if isinstance(item.error, GengateError)
                    else {"error": {"code": type(item.error).__name__, "reason": "", "fields": []}}
                )
            else:
                items[item.index] = _response(item.response)
        observed = {"items": []}
        for i, (want, req) in enumerate(zip(expect["items"], v["requests"], strict=True)):
            got = items.get(i)
            if got is None:
                failures.append(f"item {i} missing")
                continue
            sub = {k: val for k, val in want.items() if k != "ok"}
            failures += [f"item {i}: {f}" for f in check(sub, got, req)]
            observed["items"].append(got["error"] if "error" in got else _observe(got))
    else:
        failures.append(f"unknown call {call}")
    if probe:
        not_aborted = await_abort(client, probe, before)
        failures += not_aborted
        observed["server_aborted"] = not not_aborted
    if attempts:
        made = abandoned(client, attempts["probe"]) - calls_before
        observed["server_attempts"] = made
        if made != attempts["count"]:
            failures.append(f"the server saw {made} attempts, expected {attempts['count']}")
    return {"name": v["name"], "ok": not failures, "failures": failures, "observed": observed}


def _guarded(client: Client, v: dict[str, Any]) -> dict[str, Any]:
    try:
        if "client" in v:  # this vector's own client options (e.g. max_retries)
            with Client(client.address, timeout=60, **v["client"]) as own:
                return run_vector(own, v)
        return run_vector(client, v)
    except Exception as exc:  # a runner crash is this vector's failure, not the suite's end
        return {"name": v["name"], "ok": False, "failures": [f"{type(exc).__name__}: {exc}"], "observed": {}}


def _batch_request(request: dict[str, Any]) -> dict[str, Any]:
    model, prompt, options = _kwargs(request)
    return {"model": model, "prompt": prompt, **options}


def main() -> None:
    address = sys.argv[1]
    path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).with_name("vectors.json")
    vectors = json.loads(path.read_text())["vectors"]
    with Client(address, timeout=60) as client:
        results = [_guarded(client, v) for v in vectors]
    json.dump({"language": "python", "results": results}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
