"""The peers bench/run measures gengate against, each in a process of its own: the fake OpenAI
upstream (tests/providers/fake_openai.py), LiteLLM's proxy (from .venv-bench, made by
bench/setup-peers) and llama-cpp-python's server (tests/providers/llamacpp_peer.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from common import REPO

PROVIDER_TESTS = REPO / "tests" / "providers"
sys.path.insert(0, str(PROVIDER_TESTS))  # the fakes and the llama.cpp peer live beside the provider tests

import fake_openai  # noqa: E402
from llamacpp_peer import free_port, llamacpp_server, stop, wait_http  # noqa: E402

UPSTREAM_KEY = fake_openai.API_KEY
UPSTREAM_MODEL = "gpt-fake"
LITELLM_MASTER_KEY = "sk-bench-litellm-master-0123456789"  # the proxy refuses to start without one
SKIPPED_NO_VENV = "skipped: run bench/setup-peers"

__all__ = ["bench_python", "bench_venv", "fake_upstream", "litellm_proxy", "llamacpp_server"]


def bench_venv() -> Path | None:
    """The benchmark's own venv (GENGATE_BENCH_VENV, default .venv-bench) if it has LiteLLM's proxy."""
    venv = Path(os.environ.get("GENGATE_BENCH_VENV") or REPO / ".venv-bench")
    return venv if (venv / "bin" / "litellm").exists() else None


def bench_python() -> Path | None:
    """The bench venv's python (it has matplotlib), or None without the venv."""
    venv = bench_venv()
    return None if venv is None else venv / "bin" / "python"


def upstream_model(upstream: str) -> dict[str, Any]:
    """The gengate model entry (`gpt`) that proxies the fake upstream at `upstream`."""
    return {
        "name": "gpt",
        "backend": "openai",
        "model": UPSTREAM_MODEL,
        "base_url": upstream + "/v1",
        "api_key": UPSTREAM_KEY,
    }


@contextlib.contextmanager
def fake_upstream() -> Iterator[str]:
    """The loopback fake OpenAI API in its own process (so its Python does not share the load
    generator's GIL); yields its base URL (without /v1). It serves until its stdin closes."""
    with fake_process([str(PROVIDER_TESTS / "fake_openai.py")], "OpenAI") as url:
        yield url


@contextlib.contextmanager
def fake_process(argv: list[str], what: str) -> Iterator[str]:
    """`python argv` (a fake upstream, run in tests/providers) in its own process, serving until
    its stdin closes; yields the first line it prints, which starts with its base URL."""
    proc = subprocess.Popen(
        [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=PROVIDER_TESTS
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("http://"):
            raise RuntimeError(f"the fake {what} upstream did not start (exit {proc.poll()})")
        yield line
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def litellm_proxy(venv: Path, upstream: str, *, timeout_s: float = 120.0) -> Iterator[str]:
    """LiteLLM's proxy from `venv`, routing model `gpt-fake` to the upstream as an OpenAI model;
    yields its base URL (without /v1). Offline: the local model cost map; logs at ERROR only."""
    with tempfile.TemporaryDirectory(prefix="gengate-bench-litellm-") as tmp:
        config = {
            "model_list": [
                {
                    "model_name": UPSTREAM_MODEL,
                    "litellm_params": {
                        "model": f"openai/{UPSTREAM_MODEL}",
                        "api_base": upstream + "/v1",
                        "api_key": UPSTREAM_KEY,
                    },
                }
            ],
            "general_settings": {"master_key": LITELLM_MASTER_KEY},
        }
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        log_path = Path(tmp) / "litellm.log"
        with log_path.open("wb") as log:
            command = [str(venv / "bin" / "litellm"), "--config", str(path), "--host", "127.0.0.1"]
            proc = subprocess.Popen(
                [*command, "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(proc, url + "/health/liveliness", log_path, timeout_s, "LiteLLM's proxy")
            yield url
        finally:
            stop(proc, 15)
