"""The backend-kind table (registry.KINDS) is the one source every layer reads: each row's class
imports and says the same kind, its extra exists, its key variables are what the provider reads,
and the worker factory, tracing and zero-config defaults follow the rows."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from gengate import errors
from gengate.config import parse_config
from gengate.providers.base import ProviderBackend
from gengate.providers.defaults import default_provider_entries
from gengate.registry import KINDS, backend_class, kind_spec, kinds_where
from gengate.workers import factory

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
IMPORTABLE = sorted(set(KINDS) - {"vllm"})  # vllm needs its own stack (scripts/setup-vllm)


@pytest.mark.parametrize("kind", IMPORTABLE)
def test_each_row_names_a_class_of_its_own_kind(kind: str) -> None:
    cls = backend_class(kind)
    assert cls.kind == kind
    spec = KINDS[kind]
    assert spec.extra is None or spec.extra in EXTRAS, f"{kind}: no extra {spec.extra!r} in pyproject.toml"
    assert (spec.role == "provider") == issubclass(cls, ProviderBackend)  # type: ignore[arg-type]


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(errors.ConfigError) as info:
        kind_spec("openia")
    assert "unknown backend 'openia'" in str(info.value) and "openai" in str(info.value)


@pytest.mark.parametrize("kind", sorted(k for k, s in KINDS.items() if s.key_envs))
async def test_a_kind_reads_its_standard_key_variable(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`backend: openai` with no key in the config reads OPENAI_API_KEY, as `anthropic` reads
    ANTHROPIC_API_KEY: the same rule for every provider, from its row."""
    for spec in KINDS.values():
        for variable in spec.key_envs:
            monkeypatch.delenv(variable, raising=False)
    variable = KINDS[kind].key_envs[-1]
    monkeypatch.setenv(variable, f"key-for-{kind}-0123456789")
    entry = {"name": "m", "backend": kind, "model": "x", "base_url": "http://127.0.0.1:9/v1"}
    if kind == "azure_openai":
        entry["azure_endpoint"] = "http://127.0.0.1:9"
    config = parse_config({"models": [entry]}).models[0]
    backend = backend_class(kind)("m", config.options)
    assert isinstance(backend, ProviderBackend)
    assert backend.api_key == f"key-for-{kind}-0123456789"


async def test_a_missing_key_names_the_variables_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = parse_config({"models": [{"name": "m", "backend": "openai", "model": "x"}]}).models[0]
    backend = backend_class("openai")("m", config.options)
    with pytest.raises(errors.ConfigError) as info:
        await backend.start()
    assert "set OPENAI_API_KEY or api_key" in str(info.value)


def test_a_server_never_sends_a_key_meant_for_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generic OpenAI-compatible server reads no standard variable: OPENAI_API_KEY is not its."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-you-0123456789")
    for kind in ("openai_compatible", "vllm_server", "sglang", "llamacpp_server", "ollama", "litellm"):
        assert KINDS[kind].key_envs == ()
        entry = {"name": "m", "backend": kind, "model": "x", "base_url": "http://127.0.0.1:9/v1"}
        config = parse_config({"models": [entry]}).models[0]
        backend = backend_class(kind)("m", config.options)
        assert isinstance(backend, ProviderBackend) and backend.api_key is None, kind


def test_the_worker_factory_and_defaults_follow_the_rows() -> None:
    assert factory.LOCAL_ENGINES == {"scripted", "llamacpp", "transformers", "mlx", "vllm"}
    assert factory.PROCESS_BY_DEFAULT == {"llamacpp", "transformers", "mlx", "vllm"}
    assert factory.GPU_BY_DEFAULT == {"vllm"}
    assert factory.CPU_THREADED == {"llamacpp", "transformers", "mlx"}
    assert kinds_where("composite") == {"fallback", "mixture_of_agents", "preset"}
    with_defaults = {k for k, s in KINDS.items() if s.default_model}
    env = {variable: "set-0123456789" for k in with_defaults for variable in KINDS[k].key_envs}
    entries = default_provider_entries(env)
    assert {e["backend"] for e in entries} == with_defaults  # every SDK is installed in the test env
    assert all(e["api_key_env"] in KINDS[e["backend"]].key_envs for e in entries)


def test_spans_name_the_genai_provider_from_the_row() -> None:
    assert kind_spec("mistral").provider_name == "mistral_ai"
    assert kind_spec("azure_openai").provider_name == "azure.ai.openai"
    assert kind_spec("sglang").provider_name == "sglang"  # no convention name: the kind
