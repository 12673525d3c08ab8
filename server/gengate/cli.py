"""The `gengate` command: serve, generate, models, demo.

`generate` passes values to the server exactly as given: the server is the one judge of what
is valid, so e.g. `--max-tokens 0` or `--n 1000` reach it and come back as INVALID_ARGUMENT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from gengate_client import (
    AsyncClient,
    Client,
    GengateError,
    Magpie,
    OutputError,
    Regex,
    Response,
    StreamDelta,
    StreamEnd,
    StreamFrame,
    StreamStart,
)
from gengate_proto.v1 import generation_pb2
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field

from gengate.cli_options import (
    EXIT_RPC_ERROR,
    EXIT_USAGE,
    CliError,
    add_client_options,
    add_request_options,
    call_metadata,
    generate_kwargs,
    print_rpc_error,
)
from gengate.logs import LOG_FORMATS, LOG_LEVELS, configure_logging


def _message_json(message: Any, indent: int | None) -> str:
    """Protobuf JSON, each complete tool call also carrying its `arguments` as parsed JSON (beside
    `argumentsJson`), so `jq '.generations[0].toolCalls[0].arguments.city'` works."""
    data = json_format.MessageToDict(message)
    calls = [c for g in data.get("generations", []) for c in g.get("toolCalls", [])]
    calls += data.get("end", {}).get("toolCalls", [])
    for call in calls:
        call["arguments"] = json.loads(call.get("argumentsJson") or "{}")
    return json.dumps(data, indent=indent)


def _frame_json(frame: StreamFrame) -> str:
    if isinstance(frame, StreamStart):
        pb = generation_pb2.GenerateStreamResponse(start=frame.raw)
    elif isinstance(frame, StreamDelta):
        pb = generation_pb2.GenerateStreamResponse(delta=frame.raw)
    else:
        pb = generation_pb2.GenerateStreamResponse(end=frame.raw)
    return _message_json(pb, None)


def _call_lines(calls: Sequence[Any], prefix: str = "") -> list[str]:
    return [f"{prefix}call {c.name}({c.arguments_json}) id={c.id}" for c in calls]


def _print_response(response: Response, as_json: bool) -> None:
    if as_json:
        print(_message_json(response.raw, 2))
        return
    several = len(response.generations) > 1
    for generation in response.generations:
        prefix = f"[{generation.index}] " if several else ""
        if generation.conversation:  # Magpie: the conversation, a turn per paragraph
            print("\n".join(f"{prefix}{turn.role}: {turn.text}" for turn in generation.conversation))
            continue
        if generation.text or not generation.tool_calls:
            print(generation.text)
        for line in _call_lines(generation.tool_calls, prefix):
            print(line)


def _stream(client: Client, model: str, prompt: str | None, kwargs: dict[str, Any], as_json: bool) -> None:
    """Prints deltas as they arrive; with several generations each is printed when it ends."""
    several = (kwargs.get("n") or 1) > 1
    pending: dict[int, list[str]] = {}
    for frame in client.generate_stream(model, prompt, **kwargs):
        if as_json:
            print(_frame_json(frame), flush=True)
        elif isinstance(frame, StreamDelta):
            if several:
                pending.setdefault(frame.index, []).append(frame.text)
            else:
                sys.stdout.write(frame.text)
                sys.stdout.flush()
        elif isinstance(frame, StreamEnd):
            prefix = f"[{frame.index}] " if several else ""
            if several:
                print(prefix + "".join(pending.pop(frame.index, [])), flush=True)
            else:
                print(flush=True)
            for line in _call_lines(frame.tool_calls, prefix):
                print(line, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    kwargs = generate_kwargs(args)
    if args.magpie is not None:
        kwargs["magpie"] = Magpie(args.magpie, system_prompt=args.system, n_turns=args.turns)
    elif args.system is not None or args.turns is not None:
        raise CliError("--system and --turns go with --magpie")
    metadata = call_metadata(args.metadata or [])
    with Client(args.address, metadata=metadata or None, timeout=args.timeout) as client:
        try:
            if args.stream:
                _stream(client, args.model, args.prompt, kwargs, args.json)
                return 0
            try:
                response = client.generate(args.model, args.prompt, **kwargs)
            except OutputError as exc:
                if exc.response is None:
                    raise
                # The call succeeded; show the server's answer as it is and say why it is not complete.
                print(f"warning: {exc}", file=sys.stderr)
                response = exc.response
            _print_response(response, args.json)
        except GengateError as exc:
            print_rpc_error(exc, sys.stderr)
            return EXIT_RPC_ERROR
    return 0


def _format_models_table(models: Sequence[Any]) -> str:
    header = ("NAME", "BACKEND", "CONSTRAINTS", "GRAMMARS", "MAX_N", "CONTEXT", "FEATURES", "OPTIONS")
    rows = [header]
    for m in models:
        caps = m.capabilities
        constraints = ",".join(f"{c.kind.lower()}={c.enforcement.lower()}" for c in caps.constraints) or "-"
        grammars = ",".join(g.lower() for g in caps.grammar_syntaxes) or "-"
        features = [
            name for name, on in (("chat", caps.chat), ("logprobs", caps.logprobs), ("seed", caps.seed)) if on
        ]
        features += [m.lower() for m in caps.input_modalities if m.value != "TEXT"]
        context = str(caps.context_length) if caps.context_length else "?"
        options = ",".join(caps.backend_options) or "-"
        rows.append(
            (
                m.name,
                m.backend,
                constraints,
                grammars,
                str(caps.max_n),
                context,
                ",".join(features) or "-",
                options,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def cmd_models(args: argparse.Namespace) -> int:
    metadata = call_metadata(args.metadata or [])
    with Client(args.address, metadata=metadata or None, timeout=args.timeout) as client:
        try:
            models = client.list_models()
        except GengateError as exc:
            print_rpc_error(exc, sys.stderr)
            return EXIT_RPC_ERROR
    if args.json:
        print(json_format.MessageToJson(generation_pb2.ListModelsResponse(models=[m.raw for m in models])))
    else:
        print(_format_models_table(models))
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from gengate.config_schema import config_schema

    print(json.dumps(config_schema(), indent=2, sort_keys=True))
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    from gengate.config import load_config
    from gengate.errors import ConfigError
    from gengate.workers.factory import check_model

    try:
        config = load_config(args.file)
        for model in config.models:
            check_model(model)
    except ConfigError as exc:
        print(f"gengate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    kinds = ", ".join(sorted({m.backend for m in config.models}))
    callers = f", {len(config.callers)} caller(s)" if config.callers else ""
    print(f"{args.file}: ok: {len(config.models)} model(s) ({kinds}){callers}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from gengate.config import load_config
    from gengate.errors import ConfigError

    configure_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"gengate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.metrics_port is not None:  # the chart sets it, config or not: server.metrics.port
        try:
            config = _with_metrics_port(config, args.metrics_port)
        except ConfigError as exc:
            print(f"gengate: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from gengate.api.server import serve

    try:
        _check_can_serve(config.server, args.host, args.port)
        serve(config, args.host, args.port)
    except (CliError, ConfigError, OSError, RuntimeError, OverflowError, ValueError) as exc:
        # Start-up failures (a token variable not set, unreadable or mismatched TLS files, a
        # port in use, a host that does not resolve, an option grpc refuses): one line, exit 2,
        # no traceback. grpc's own messages can span lines; the first says what failed.
        print(f"gengate: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _with_metrics_port(config: Any, port: int) -> Any:
    """`config` with server.metrics.port set, checked as the config file's would be."""
    import dataclasses

    from pydantic import ValidationError

    from gengate.config import ServerSettings
    from gengate.errors import ConfigError

    data = config.server.model_dump()
    data["metrics"]["port"] = port
    try:
        server = ServerSettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"--metrics-port {port}: {problems}") from None
    return dataclasses.replace(config, server=server)


def _one_line(exc: BaseException) -> str:
    """An exception as one line of text: its first non-empty line, else its type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _check_can_serve(settings: Any, host: str | None, port: int | None) -> None:
    """Fails fast, before any model loads and with the reason, where grpc would fail at bind
    with "Failed to bind" (and its own log lines): TLS files that are not a certificate chain
    and its key, a host that does not resolve, a port another process listens on."""
    cert, key = settings.tls_cert_file, settings.tls_key_file
    if cert and key and Path(cert).expanduser().is_file() and Path(key).expanduser().is_file():
        _check_tls_pair(str(Path(cert).expanduser()), str(Path(key).expanduser()))
    host = host or settings.host
    port = settings.port if port is None else port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise CliError(f"cannot serve on {host}:{port}: the host does not resolve ({reason})") from exc
    if port == 0:
        return
    failures = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does
            try:
                probe.bind(address)
            except OSError as exc:
                failures.append(exc.strerror or str(exc))
    if len(failures) == len(addresses):  # grpc serves when any resolved address binds
        raise CliError(f"cannot serve on {host}:{port}: {failures[0]}")


def _check_tls_pair(cert: str, key: str) -> None:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback, so that an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise CliError(
            f"server.tls_cert_file {cert} and server.tls_key_file {key} are not a PEM certificate "
            f"chain and its private key ({exc.reason or exc})"
        ) from exc


class City(BaseModel):
    """The demo's structured-output type: the server enforces the schema, pydantic validates it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=40_000_000)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


def _header(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def _ensure_tiny_model() -> None:
    """Builds the tiny model into its cache on first use, saying so (later starts reuse it)."""
    from gengate.models.tiny import MARKER_FILE, build_tiny_model, default_tiny_dir

    dest = default_tiny_dir()
    if (dest / MARKER_FILE).exists():
        return
    print(f"building tiny model into {dest} ...", flush=True)
    started = time.perf_counter()
    build_tiny_model(dest)
    print(f"built in {time.perf_counter() - started:.2f}s", flush=True)


async def _demo_calls(client: AsyncClient) -> None:
    model = "tiny"
    _header("plain text (random weights: nonsense, but a real model)")
    response = await client.generate(model, "Write a short story about a robot.", max_tokens=24, seed=7)
    print(repr(response.text))
    print(f"finish={response.finish_reason}  usage={response.usage}  seed={response.seed}")

    _header("stream (deltas printed as they arrive)")
    async for frame in client.generate_stream(
        model, "Hello, world! How are you today?", max_tokens=24, seed=3
    ):
        if isinstance(frame, StreamDelta):
            print(frame.text, end="", flush=True)
        elif isinstance(frame, StreamEnd):
            print(f"\n[end: {frame.finish_reason}, {frame.usage.output_tokens} tokens]")

    _header("pydantic object: City(name, population >= 0, country_code ^[A-Z]{2}$)")
    try:
        city = await client.generate_object(
            model, "A city as JSON:", output_type=City, max_tokens=200, seed=11
        )
        print(repr(city))
    except OutputError as exc:  # a random-weights model may ramble until max_tokens
        print(f"({exc})")

    # [0-9], not \d: \d matches any Unicode digit (e.g. fullwidth ９), and the engine knows it.
    _header(r"regex: phone number \([0-9]{3}\) [0-9]{3}-[0-9]{4}")
    phone = await client.generate(
        model, "Phone:", output_type=Regex(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"), seed=5
    )
    print(f"{phone.parsed}   (enforcement={phone.enforcement})")

    _header("choice: Literal['positive', 'negative', 'neutral']")
    sentiment_type = Literal["positive", "negative", "neutral"]
    sentiment = await client.generate(model, "The food was great!", output_type=sentiment_type, seed=2)
    print(sentiment.parsed)

    _header("batch: one bad item does not fail the others")
    items = await client.batch_generate(
        [
            {"model": model, "prompt": "One", "max_tokens": 8, "seed": 1},
            {"model": "no-such-model", "prompt": "Two"},
            {"model": model, "prompt": "Three", "max_tokens": 0},
        ]
    )
    for item in items:
        if item.response is not None:
            print(f"[{item.index}] ok: {item.response.text!r}")
        elif isinstance(item.error, GengateError):
            print(f"[{item.index}] {item.error.code_name}: {item.error.message}")


async def _demo() -> int:
    from gengate.api.server import start_server
    from gengate.config import load_config
    from gengate.errors import ConfigError

    try:
        config = load_config(None)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _ensure_tiny_model()
    started = time.perf_counter()
    server = await start_server(config, host="127.0.0.1", port=0)
    print(
        f"gengate serving on {server.address} (started in {time.perf_counter() - started:.1f}s)", flush=True
    )
    try:
        async with AsyncClient(server.address, timeout=120) as client:
            await _demo_calls(client)
    except GengateError as exc:
        print_rpc_error(exc, sys.stderr)
        return EXIT_RPC_ERROR
    finally:
        await server.stop(grace=1.0)
    print("\nserver stopped", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return asyncio.run(_demo())


def cmd_compile(args: argparse.Namespace) -> int:
    from gengate.compiled import main as compile_main

    return compile_main()


def version_line() -> str:
    """`gengate --version`: the server package's version and the contract it serves."""
    from importlib.metadata import version

    return f"gengate {version('gengate')} (contract gengate.v1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gengate", description="One gRPC service for text and typed output."
    )
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=os.environ.get("GENGATE_LOG_LEVEL", "INFO").upper(),
        help="server log level (default INFO, or $GENGATE_LOG_LEVEL); workers log WARNING and up, "
        "everything at DEBUG",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("GENGATE_LOG_FORMAT", "text"),
        help="text, or json: one object per line with time, level, logger, message, request_id, model, "
        "caller (default text, or $GENGATE_LOG_FORMAT); workers log in the same format",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server until SIGINT/SIGTERM")
    serve.add_argument("--config", help="YAML config file (default: the embedded tiny model)")
    serve.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default from config: 50051; 0 picks a free one)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this HTTP port (overrides server.metrics.port; 0 picks one)",
    )
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="ask a served model for text or structured output")
    add_client_options(gen)
    gen.add_argument("--model", required=True)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text")
    source.add_argument("--messages", metavar="FILE", help="JSON list of {role, content} ('-' for stdin)")
    source.add_argument(
        "--magpie",
        metavar="PRESET|TEXT",
        help="the model writes the user turn itself (Magpie): llama3, qwen2, phi3, gemma or a pre-query text",
    )
    gen.add_argument("--system", help="with --magpie: a system prompt steering the instructions")
    gen.add_argument(
        "--turns", type=int, help="with --magpie: user turns to write, each answered (default 1)"
    )
    add_request_options(gen)
    gen.add_argument("--request-id")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list served models and their capabilities")
    add_client_options(models)
    models.set_defaults(func=cmd_models)

    demo = sub.add_parser("demo", help="start the server on the tiny model in-process and show each feature")
    demo.set_defaults(func=cmd_demo)

    compile_ = sub.add_parser(
        "compile", help="compile the per-call hot paths to C with mypyc, in place (needs mypy and gcc)"
    )
    compile_.set_defaults(func=cmd_compile)

    config = sub.add_parser("config", help="the config file: its JSON Schema, or check one without serving")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    schema = config_sub.add_parser("schema", help="print the JSON Schema of the whole config file")
    schema.set_defaults(func=cmd_config_schema)
    check = config_sub.add_parser(
        "check", help="validate a config file (with the GENGATE_SERVER_* overrides) without starting anything"
    )
    check.add_argument("file", help="the YAML config file")
    check.set_defaults(func=cmd_config_check)

    from gengate.cli_batch import add_batch_commands

    add_batch_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gengate` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except CliError as exc:
        print(f"gengate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:  # e.g. a negative value for an unsigned proto field
        print(f"gengate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return status
