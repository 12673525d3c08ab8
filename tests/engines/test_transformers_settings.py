"""Transformers load settings (issue 12): revision, trust_remote_code, model_kwargs, device_map,
observed on what from_pretrained really loaded from the tiny model folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gengate.config import parse_config
from gengate.domain import GenerationRequest, StoppingCriteria
from gengate.engines.transformers import TransformersBackend, TransformersOptions
from gengate.errors import ConfigError
from gengate.models.tiny import TinyModelPaths
from gengate.workers.backend import WorkerBackend, WorkerStartError

pytest.importorskip("torch")
pytest.importorskip("transformers")

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
async def started() -> AsyncIterator[list[TransformersBackend]]:
    """Backends a test starts (append them); all closed at the end."""
    backends: list[TransformersBackend] = []
    yield backends
    for backend in backends:
        await backend.aclose()


async def _start(started: list[TransformersBackend], model: str | Path, **options: Any) -> Any:
    """Starts a backend on `model` and returns the model from_pretrained gave it."""
    backend = TransformersBackend(
        "tiny-hf", TransformersOptions(model=str(model), max_batch_size=2, **options)
    )
    started.append(backend)
    await backend.start()
    assert backend._loaded is not None
    return backend._loaded.scheduler.batch.model


def _entry(**options: object) -> dict[str, object]:
    return {"name": "m", "backend": "transformers", **options}


# --- model_kwargs ---------------------------------------------------------------------------------


async def test_model_kwargs_reach_from_pretrained(
    tiny_model: TinyModelPaths, started: list[TransformersBackend]
) -> None:
    default = await _start(started, tiny_model.hf_dir)
    assert default.config._attn_implementation != "eager"
    model = await _start(
        started,
        tiny_model.hf_dir,
        model_kwargs={"attn_implementation": "eager", "max_position_embeddings": 64},
    )
    assert model.config._attn_implementation == "eager"
    assert started[1].capabilities.context_length == 64  # a config override, read back after the load
    result = await started[1].generate(
        GenerationRequest(model="tiny-hf", prompt="Hi", stopping=StoppingCriteria(max_tokens=3))
    )
    assert result.usage.output_tokens == 3


async def test_model_kwargs_from_pretrained_refuses_fail_the_start_naming_them(
    tiny_model: TinyModelPaths, started: list[TransformersBackend]
) -> None:
    with pytest.raises(ConfigError) as info:
        await _start(started, tiny_model.hf_dir, model_kwargs={"rope_wobble": 2})
    message = str(info.value)
    assert message.startswith(
        f"model 'tiny-hf': could not load the model of '{tiny_model.hf_dir}' (with model_kwargs)"
    )
    assert "unexpected keyword argument 'rope_wobble'" in message


def test_model_kwargs_may_not_set_what_gengate_sets() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            {"models": [_entry(tiny=True, model_kwargs={"torch_dtype": "float16", "revision": "x"})]}
        )
    assert (
        "models[0] (m): model_kwargs: Value error, 'revision' is set by gengate from `revision`; "
        "'torch_dtype' is set by gengate from `dtype`"
    ) in str(info.value)


# --- trust_remote_code ----------------------------------------------------------------------------


@pytest.fixture
def folder_with_code(tiny_model: TinyModelPaths, tmp_path: Path) -> Path:
    """The tiny model with modeling code of its own (config.json's auto_map names a subclass)."""
    folder = tmp_path / "with-code"
    shutil.copytree(tiny_model.hf_dir, folder)
    (folder / "modeling_marked.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\n"
        "class MarkedLlamaForCausalLM(LlamaForCausalLM):\n"
        '    """The tiny Llama under another name: its code ran."""\n'
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_marked.MarkedLlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


async def test_trust_remote_code_runs_the_folders_own_code_only_when_set(
    folder_with_code: Path, started: list[TransformersBackend]
) -> None:
    assert type(await _start(started, folder_with_code)).__name__ == "LlamaForCausalLM"
    trusted = await _start(started, folder_with_code, trust_remote_code=True)
    assert type(trusted).__name__ == "MarkedLlamaForCausalLM"


def test_trust_remote_code_must_be_a_real_boolean() -> None:
    with pytest.raises(ConfigError, match=r"trust_remote_code: Input should be a valid boolean"):
        parse_config({"models": [_entry(tiny=True, trust_remote_code="yes")]})


# --- revision -------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["tiny", "folder"])
def test_revision_of_a_local_folder_is_refused(tiny_model: TinyModelPaths, source: str) -> None:
    """transformers ignores `revision` for a folder on disk: refused rather than silently dropped."""
    where = {"tiny": True} if source == "tiny" else {"model": str(tiny_model.hf_dir)}
    with pytest.raises(ConfigError, match=r"'revision' applies to a hub id; a local folder"):
        parse_config({"models": [_entry(**where, revision="v1")]})


@pytest.fixture
def hub_cache(tiny_model: TinyModelPaths, tmp_path: Path) -> Path:
    """A Hugging Face hub cache holding repo gengate/tiny at tag v1 only (no main), for offline use."""
    repo = tmp_path / "hub" / "models--gengate--tiny"
    shutil.copytree(tiny_model.hf_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(COMMIT)
    return tmp_path / "hub"


def _hub_worker(hub_cache: Path, revision: str) -> WorkerBackend:
    """A worker (fresh process: the hub client reads its variables at import) offline on the cache."""
    return WorkerBackend(
        "tiny-hub",
        "transformers",
        {"model": "gengate/tiny", "revision": revision, "max_batch_size": 2},
        env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"},
    )


async def test_revision_of_a_hub_id_picks_what_loads(hub_cache: Path) -> None:
    backend = _hub_worker(hub_cache, "v1")
    await backend.start()
    try:
        result = await backend.generate(
            GenerationRequest(model="tiny-hub", prompt="Hi", stopping=StoppingCriteria(max_tokens=3))
        )
        assert result.usage.output_tokens == 3
    finally:
        await backend.aclose()

    missing = _hub_worker(hub_cache, "v2")
    with pytest.raises(WorkerStartError) as info:
        await missing.start()
    assert "model 'tiny-hub': could not load the tokenizer of 'gengate/tiny' at revision 'v2': OSError" in (
        info.value.message
    )


# --- device_map -----------------------------------------------------------------------------------


def test_device_map_goes_instead_of_device() -> None:
    with pytest.raises(ConfigError, match=r"set one of 'device' and 'device_map'"):
        parse_config({"models": [_entry(tiny=True, device="cpu", device_map="auto")]})


@pytest.mark.skipif(HAS_ACCELERATE, reason="accelerate is installed: the device map loads")
async def test_device_map_without_accelerate_fails_the_start_saying_so(
    tiny_model: TinyModelPaths, started: list[TransformersBackend]
) -> None:
    with pytest.raises(ConfigError) as info:
        await _start(started, tiny_model.hf_dir, device_map="cpu")
    message = str(info.value)
    assert message.startswith("model 'tiny-hf': could not load the model of ")
    assert "(with device_map): ValueError" in message and "requires `accelerate`" in message


@pytest.mark.skipif(not HAS_ACCELERATE, reason="a device_map needs accelerate")
async def test_device_map_places_the_model(
    tiny_model: TinyModelPaths, started: list[TransformersBackend]
) -> None:
    model = await _start(started, tiny_model.hf_dir, device_map={"": "cpu"})
    assert model.hf_device_map == {"": "cpu"}
    result = await started[0].generate(
        GenerationRequest(model="tiny-hf", prompt="Hi", stopping=StoppingCriteria(max_tokens=3))
    )
    assert result.usage.output_tokens == 3
