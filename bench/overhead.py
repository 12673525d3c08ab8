"""What the service costs: the same llama.cpp workload in-process vs through gengate, and bare RPC.

(a) direct: llama-cpp-python's `Llama.create_completion` on the tiny GGUF, in this process
    (one lock around the model, as the engine serialises decoding too);
(b) gengate: the same requests through a `gengate serve` subprocess and `gengate_client.AsyncClient`,
    once with the model in its worker process (the default) and once inline in the server;
(c) RPC: the model-free `scripted` backend vs a bare grpcio echo server, unary and streaming.

Ratios are gengate / peer for tokens/s and requests/s (1.0 = no overhead; 0.8 = 20% slower).

    .venv/bin/python bench/overhead.py [--quick] [--requests N] [--rpc-requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from common import PROMPT, Pair, RunStats, gengate_server, print_ratios, print_table, run_interleaved

MAX_TOKENS = 32
SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}
ECHO_PROMPT = "hello world"
UNARY = "/bench.Echo/Unary"
STREAM = "/bench.Echo/Stream"
MODELS: list[dict[str, Any]] = [
    {"name": "tiny", "backend": "llamacpp", "tiny": True},
    {"name": "tiny-inline", "backend": "llamacpp", "tiny": True, "isolation": "inline"},
    {"name": "echo", "backend": "scripted"},
]


# -- (a) direct llama.cpp ----------------------------------------------------------------


def direct_caller() -> Callable[[int], Awaitable[int]]:
    """create_completion on the tiny GGUF in this process; returns output tokens."""
    import llama_cpp
    from gengate.models.tiny import build_tiny_model, default_tiny_dir

    path = build_tiny_model(default_tiny_dir()).gguf_path
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, verbose=False)
    lock = threading.Lock()

    def complete(seed: int) -> int:
        with lock:
            out: Any = llm.create_completion(
                PROMPT, max_tokens=MAX_TOKENS, top_k=0, min_p=0.0, repeat_penalty=1.0, seed=seed, **SAMPLING
            )
        return int(out["usage"]["completion_tokens"])

    async def call(i: int) -> int:
        return await asyncio.to_thread(complete, i)

    return call


async def engine_caller() -> tuple[Callable[[int], Awaitable[int]], Callable[[], Awaitable[None]]]:
    """gengate's LlamaCppBackend in this process, without server or client; and its close."""
    from gengate.domain import GenerationRequest, SamplingParams, StoppingCriteria
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    backend = LlamaCppBackend("tiny", LlamaCppOptions(tiny=True))
    await backend.start()

    async def call(i: int) -> int:
        request = GenerationRequest(
            model="tiny",
            prompt=PROMPT,
            sampling=SamplingParams(seed=i, **SAMPLING),
            stopping=StoppingCriteria(max_tokens=MAX_TOKENS),
        )
        result = await backend.generate(request)
        return int(result.usage.output_tokens)

    return call, backend.aclose


# -- (b), (c) gengate ----------------------------------------------------------------------


def gengate_caller(client: Any, model: str) -> Callable[[int], Awaitable[int]]:
    async def call(i: int) -> int:
        response = await client.generate(model, PROMPT, max_tokens=MAX_TOKENS, seed=i, **SAMPLING)
        return int(response.usage.output_tokens)

    return call


def echo_unary(client: Any) -> Callable[[int], Awaitable[int]]:
    async def call(i: int) -> int:
        await client.generate("echo", ECHO_PROMPT, max_tokens=MAX_TOKENS)
        return 0

    return call


def echo_stream(client: Any) -> Callable[[int], Awaitable[int]]:
    async def call(i: int) -> int:
        return sum([1 async for _ in client.generate_stream("echo", ECHO_PROMPT, max_tokens=MAX_TOKENS)])

    return call


# -- (c) the bare grpcio peer --------------------------------------------------------------


async def serve_echo() -> None:
    """A minimal grpc.aio server: unary echo, and a stream of `frames` echoes (first request byte)."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        for _ in range(request[0]):
            yield request[1:]

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def peer_unary(channel: grpc.aio.Channel) -> Callable[[int], Awaitable[int]]:
    method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(UNARY)
    payload = ECHO_PROMPT.encode()

    async def call(i: int) -> int:
        await method(payload)
        return 0

    return call


def peer_stream(channel: grpc.aio.Channel, frames: int) -> Callable[[int], Awaitable[int]]:
    method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(STREAM)
    payload = bytes([frames]) + ECHO_PROMPT.encode()

    async def call(i: int) -> int:
        return sum([1 async for _ in method(payload)])

    return call


def start_peer() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-echo"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("echo serving on "):
        proc.kill()
        raise RuntimeError("the bare grpcio echo server did not start")
    return proc, line.split()[3]


# -- the runs ------------------------------------------------------------------------------


def raw_stub_unary(channel: grpc.aio.Channel) -> Callable[[int], Awaitable[int]]:
    """gengate's Generate through the bare generated stub: the server's cost without the client library."""
    from gengate_client import _convert
    from gengate_client.types import Request
    from gengate_proto.v1 import generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request, _ = _convert.build_request(Request(model="echo", prompt=ECHO_PROMPT, max_tokens=MAX_TOKENS))

    async def call(i: int) -> int:
        await stub.Generate(request)
        return 0

    return call


async def run_llama(client: Any, requests: int, rounds: int) -> tuple[list[RunStats], list[Pair]]:
    direct = direct_caller()
    engine, close_engine = await engine_caller()
    variants = [
        ("direct Llama", direct),
        ("engine in-process", engine),
        ("server inline", gengate_caller(client, "tiny-inline")),
        ("server worker-proc", gengate_caller(client, "tiny")),
    ]
    rows: list[RunStats] = []
    pairs: list[Pair] = []
    try:
        for conc in (1, 8):
            base, alone, inline, worker = await run_interleaved(variants, requests, conc, rounds)
            rows += [base, alone, inline, worker]
            pairs += [(alone, base), (inline, base), (worker, base), (inline, alone)]
    finally:
        await close_engine()
    return rows, pairs


async def run_rpc(client: Any, address: str, requests: int, rounds: int) -> tuple[list[RunStats], list[Pair]]:
    frames = await echo_stream(client)(0)
    peer_proc, peer_address = start_peer()
    rows: list[RunStats] = []
    pairs: list[Pair] = []
    try:
        async with grpc.aio.insecure_channel(peer_address) as peer, grpc.aio.insecure_channel(address) as raw:
            unary = [
                ("grpcio unary", peer_unary(peer)),
                ("gengate raw-stub unary", raw_stub_unary(raw)),
                ("gengate client unary", echo_unary(client)),
            ]
            for conc in (1, 8):
                base, stub, full = await run_interleaved(unary, requests, conc, rounds)
                rows += [base, stub, full]
                pairs += [(stub, base), (full, base)]
            stream = [
                (f"grpcio stream({frames})", peer_stream(peer, frames)),
                (f"gengate client stream({frames})", echo_stream(client)),
            ]
            base, full = await run_interleaved(stream, requests, 1, rounds)
            rows += [base, full]
            pairs.append((full, base))
    finally:
        peer_proc.terminate()
        peer_proc.wait()
    return rows, pairs


async def run(requests: int, rpc_requests: int, rounds: int) -> None:
    from gengate_client import AsyncClient

    with gengate_server(MODELS) as address:
        async with AsyncClient(address) as client:
            llama_rows, llama_pairs = await run_llama(client, requests, rounds)
            rpc_rows, rpc_pairs = await run_rpc(client, address, rpc_requests, rounds)
    total = requests * rounds
    print_table(f"llama.cpp tiny: prompt ~16 tokens, max_tokens {MAX_TOKENS}, {total} requests", llama_rows)
    summary = print_ratios(llama_pairs)
    total = rpc_requests * rounds
    print_table(f"RPC only: scripted echo vs a bare grpcio echo, {total} requests", rpc_rows, tokens=False)
    summary += print_ratios(rpc_pairs, tokens=False)
    print(f"\nSUMMARY throughput ratios, 1.00 = as fast as the peer: {', '.join(summary)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="llama.cpp requests per round (64)")
    parser.add_argument("--rpc-requests", type=int, default=None, help="echo requests per round (1000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per variant (3)")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_echo:
        asyncio.run(serve_echo())
        return 0
    requests = args.requests or (16 if args.quick else 64)
    rpc_requests = args.rpc_requests or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    asyncio.run(run(requests, rpc_requests, rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
