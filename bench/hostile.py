"""Hostile input against a real server: every corpus case's status, crashes, and how long health
checks take while the hostile requests run.

The server runs as `gengate serve` in its own process, the health prober in another (so neither
the client's serialisation of 45 MB requests nor its GIL inflates the latencies); the corpus is
tests/hostile/corpus.py. Reported: cases, codes right, worker crashes (per-model health seen
NOT_SERVING, or the model no longer answering), and health-check latency while idle and while
each case runs — the ratio worst-under-attack / idle p50 is the comparable number; the
absolute worst is what the issue bounds (100 ms).

    .venv/bin/python bench/hostile.py [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hostile"))
from common import gengate_server, percentile
from corpus import CASES, SERVER_CONFIG, Case
from gengate_proto.v1 import (
    generation_pb2,
    generation_pb2_grpc,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "/gengate.v1.GenerationService/"


def probe(address: str, stop: Any, out: Any) -> None:
    """Checks overall and per-model health every 10 ms until `stop`; sends (time, latency, states)."""
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    samples: list[tuple[float, float, int, int]] = []
    while not stop.is_set():
        started = time.perf_counter()
        try:
            overall = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
            model = stub.Check(
                health_pb2.HealthCheckRequest(service="gengate.v1.GenerationService/tiny"), timeout=30
            ).status
        except grpc.RpcError:
            overall = model = -1
        samples.append((time.time(), (time.perf_counter() - started) / 2, overall, model))
        time.sleep(0.01)
    out.send(samples)


def send(channel: grpc.Channel, case: Case) -> grpc.StatusCode:
    message = case.request()
    try:
        if case.rpc == "generate":
            generation_pb2_grpc.GenerationServiceStub(channel).Generate(message, timeout=300)
        elif case.rpc == "stream":
            list(generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(message, timeout=300))
        elif case.rpc == "batch":
            list(generation_pb2_grpc.GenerationServiceStub(channel).BatchGenerate(message, timeout=300))
        else:
            method = case.rpc.removeprefix("raw:")
            if method in ("GenerateStream", "BatchGenerate"):
                list(channel.unary_stream(SERVICE + method)(message, timeout=300))
            else:
                channel.unary_unary(SERVICE + method)(message, timeout=300)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return,attr-defined]
    return grpc.StatusCode.OK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one round of 30 cases")
    args = parser.parse_args()
    cases = CASES[::4] if args.quick else CASES
    rounds = 1 if args.quick else args.rounds
    ctx = multiprocessing.get_context("spawn")
    with gengate_server(SERVER_CONFIG["models"]) as address:
        options = [("grpc.max_send_message_length", 200 * 1024 * 1024)]
        channel = grpc.insecure_channel(address, options=options)
        generation_pb2_grpc.GenerationServiceStub(channel).ListModels(generation_pb2.ListModelsRequest())
        stop = ctx.Event()
        receive, deliver = ctx.Pipe(duplex=False)
        prober = ctx.Process(target=probe, args=(address, stop, deliver))
        prober.start()
        time.sleep(2.0)  # idle baseline
        spans: list[tuple[str, float, float, bool]] = []
        for _ in range(rounds):
            for case in cases:
                began = time.time()
                code = send(channel, case)
                spans.append((case.name, began, time.time(), code == case.code))
                time.sleep(0.05)
        time.sleep(0.5)
        stop.set()
        samples: list[tuple[float, float, int, int]] = receive.recv()
        prober.join()
        alive = send(channel, Case("alive", lambda: _good(), grpc.StatusCode.OK)) == grpc.StatusCode.OK
    first = spans[0][1]
    idle = [lat for when, lat, _, _ in samples if when < first]
    attacked = [lat for when, lat, _, _ in samples if when >= first]
    not_serving = sum(1 for _, _, overall, model in samples if overall != 1 or model != 1)
    per_case: dict[str, float] = {}
    for name, began, ended, _ in spans:
        inside = [lat for when, lat, _, _ in samples if began <= when <= ended + 0.02]
        if inside:
            per_case[name] = max(per_case.get(name, 0.0), max(inside))
    right = sum(1 for *_, ok in spans if ok)
    worst = sorted(per_case.items(), key=lambda kv: -kv[1])[:5]
    idle_p50 = percentile(idle, 50)
    print(f"cases sent: {len(spans)} ({len(cases)} distinct x {rounds} rounds); codes right: {right}")
    print(f"health checks: {len(samples)}; NOT_SERVING or failed: {not_serving}; model alive after: {alive}")
    print(
        f"health latency idle p50 {idle_p50 * 1000:.1f} ms; under attack p50 "
        f"{percentile(attacked, 50) * 1000:.1f} ms, p99 {percentile(attacked, 99) * 1000:.1f} ms, "
        f"worst {max(attacked, default=0) * 1000:.0f} ms"
    )
    for name, latency in worst:
        print(f"  worst during {name!r}: {latency * 1000:.0f} ms")
    summary = {
        "cases": len(spans),
        "codes_right": right,
        "crashes": not_serving + (0 if alive else 1),
        "health_idle_p50_ms": round(idle_p50 * 1000, 1),
        "health_worst_ms": round(max(attacked, default=0) * 1000),
        "worst_over_idle": round(max(attacked, default=0) / idle_p50, 1) if idle_p50 else None,
    }
    print("SUMMARY " + json.dumps(summary))


def _good() -> Any:
    from corpus import req

    return req()


if __name__ == "__main__":
    main()
