"""What the `gengate` subcommands share: exit codes, request flags, client options, errors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from gengate_client import Choice, GengateError, Grammar, JsonObject, JsonSchema, Regex, Tool

EXIT_RPC_ERROR = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A problem with the command line or its input files: printed, exit status 2."""


def print_rpc_error(error: GengateError, out: TextIO) -> None:
    print(f"{error.code_name}: {error.message}", file=out)
    for violation in error.field_violations:
        print(f"  {violation.field}: {violation.description}", file=out)
    if error.reason:
        print(f"  reason: {error.reason}", file=out)
    if error.retry_after is not None:
        print(f"  retry after: {error.retry_after:g}s", file=out)


def _read_json(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"{what}: cannot read {path}: {exc.strerror}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what}: {path} is not valid JSON: {exc}") from exc


def _output_type(args: argparse.Namespace) -> Any:
    if args.json_schema:
        schema = _read_json(args.json_schema, "--json-schema")
        if not isinstance(schema, dict):
            raise CliError("--json-schema: the file must hold a JSON object")
        return JsonSchema(schema)
    if args.regex is not None:
        return Regex(args.regex)
    if args.choice:
        return Choice(args.choice)
    if args.grammar:
        try:
            definition = Path(args.grammar).read_text()
        except OSError as exc:
            raise CliError(f"--grammar: cannot read {args.grammar}: {exc.strerror}") from exc
        return Grammar(definition, syntax=args.grammar_syntax)
    if args.json_object:
        return JsonObject()
    return None


def call_metadata(pairs: Sequence[str]) -> list[tuple[str, str]]:
    result = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--metadata: expected KEY=VALUE, got {pair!r}")
        result.append((key.strip().lower(), value))
    return result


def generate_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "n": args.n,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "stop": args.stop or None,
        "logprobs": args.logprobs,
        "request_id": args.request_id,
        "output_type": _output_type(args),
    }
    if args.tools:
        kwargs["tools"] = _tools(args.tools)
    if args.tool_choice is not None:
        if not args.tools:
            raise CliError("--tool-choice goes with --tools")
        kwargs["tool_choice"] = args.tool_choice
    if args.option:
        kwargs["backend_options"] = dict(_backend_option(o) for o in args.option)
    if args.messages:
        messages = _read_json(args.messages, "--messages")
        if not isinstance(messages, list):
            raise CliError("--messages: the file must hold a JSON list of {role, content} objects")
        kwargs["messages"] = messages
    return kwargs


_TOOL_KEYS = {"name", "description", "parameters", "strict"}


def _tools(path: str) -> list[Tool]:
    """--tools FILE: a JSON list of {name, description, parameters, strict}; the server judges the
    values (names, schemas), this only reads the shape."""
    entries = _read_json(path, "--tools")
    if not isinstance(entries, list):
        raise CliError("--tools: the file must hold a JSON list of {name, description, parameters} objects")
    tools = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise CliError(f"--tools: entry {i} must be an object with a string `name`")
        unknown = sorted(set(entry) - _TOOL_KEYS)
        if unknown:
            raise CliError(f"--tools: entry {i} has unknown keys {unknown} (known: {sorted(_TOOL_KEYS)})")
        tools.append(
            Tool(
                name=entry["name"],
                description=str(entry.get("description") or ""),
                parameters=entry.get("parameters"),
                strict=bool(entry.get("strict", False)),
            )
        )
    return tools


def _backend_option(text: str) -> tuple[str, str | int | float | bool]:
    """KEY=VALUE: a JSON number or true/false stays typed, anything else is a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise CliError(f"--option {text!r}: expected KEY=VALUE")
    try:
        value = json.loads(raw)
    except ValueError:
        return key, raw
    return key, value if isinstance(value, bool | int | float) else raw


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="server address, HOST:PORT")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument(
        "--metadata",
        action="append",
        metavar="KEY=VALUE",
        help="gRPC metadata sent with the call (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print protobuf JSON instead of text")


def add_request_options(parser: argparse.ArgumentParser) -> None:
    """The flags that shape a request (structured output, sampling, stopping, backend options),
    shared by `generate` and `batch submit` / `batch run`."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="JSON Schema file the output must satisfy")
    shape.add_argument("--regex", metavar="RE", help="regular expression the output must fully match")
    shape.add_argument(
        "--choice", action="append", metavar="X", help="allowed output (repeat for each choice)"
    )
    shape.add_argument("--grammar", metavar="FILE", help="grammar file the output must be a sentence of")
    shape.add_argument("--json-object", action="store_true", help="output must be some JSON object")
    parser.add_argument("--grammar-syntax", choices=("lark", "gbnf", "ebnf"), default="lark")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--n", type=int, help="number of generations")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    parser.add_argument("--logprobs", type=int, metavar="K", help="return logprobs with K alternatives")
    parser.add_argument(
        "--tools",
        metavar="FILE",
        help="JSON list of tools the model may call: {name, description, parameters}",
    )
    parser.add_argument(
        "--tool-choice",
        metavar="auto|none|required|NAME",
        help="with --tools: whether and which tool must be called (default auto)",
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="backend option (repeatable; see the model's OPTIONS in `gengate models`), e.g. min_tokens=20",
    )
