"""llama.cpp load settings (issue 12): GPU offload agreeing with placement, n_batch, split_mode,
flash_attn and chat_format, observed on the real llama_cpp.Llama the engine loads (tiny GGUF)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: llamacpp)")

import llama_cpp
from gengate.config import parse_config
from gengate.domain import (
    ChatMessage,
    FinishReason,
    GenerationRequest,
    Role,
    SamplingParams,
    StoppingCriteria,
    TextPart,
)
from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions
from gengate.engines.llamacpp_settings import (
    LayerPlacement,
    check_offload,
    gpu_layers,
    layer_placement,
)
from gengate.errors import ConfigError
from gengate.models.tiny import TinyModelPaths

CPU_BUILD = not llama_cpp.llama_supports_gpu_offload()
LAYERS = 3  # the tiny model's 2 blocks + its output layer, as llama.cpp counts them
MESSAGES = (ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)), ChatMessage(Role.USER, (TextPart("Hi"),)))


@pytest.fixture
async def started(tiny_model: TinyModelPaths) -> AsyncIterator[list[LlamaCppBackend]]:
    """Backends a test starts (append them); all closed at the end, failed starts included."""
    backends: list[LlamaCppBackend] = []
    yield backends
    for backend in backends:
        await backend.aclose()


async def _start(started: list[LlamaCppBackend], tiny_model: TinyModelPaths, **options: Any) -> Any:
    """Starts a backend on the tiny GGUF and returns its llama_cpp.Llama."""
    backend = LlamaCppBackend("tiny", LlamaCppOptions(path=str(tiny_model.gguf_path), n_threads=1, **options))
    started.append(backend)
    await backend.start()
    return backend._llm


# --- offload: the rule, then the real load --------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "visible", "supports", "expected"),
    [
        (None, None, True, 0),  # inline: gengate placed nothing
        (None, "", True, 0),  # a CPU worker
        (None, "0", True, -1),  # a GPU placed, a GPU build: everything offloaded
        (None, "2,3", True, -1),
        (None, "0", False, 0),  # a GPU placed, a CPU build: CPU (with a warning)
        (0, "0", True, 0),
        (12, "1", True, 12),
        (-1, None, True, -1),  # inline on a GPU build: the GPUs the process sees
    ],
)
def test_gpu_layers_follow_placement_and_the_build(
    requested: int | None, visible: str | None, supports: bool, expected: int
) -> None:
    assert gpu_layers(requested, visible_devices=visible, supports_offload=supports, model="m") == expected


@pytest.mark.parametrize(
    ("requested", "visible", "supports", "fragment"),
    [
        (4, "0", False, "n_gpu_layers is 4, but this llama-cpp-python build has no GPU offload"),
        (-1, None, False, "llama_supports_gpu_offload() is False"),
        (-1, "", True, "n_gpu_layers is -1, but this worker was given no GPU"),
    ],
)
def test_an_offload_that_cannot_happen_is_refused(
    requested: int, visible: str | None, supports: bool, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=r"^model 'm': ") as info:
        gpu_layers(requested, visible_devices=visible, supports_offload=supports, model="m")
    assert fragment in str(info.value)


def test_metal_ignores_cuda_visible_devices() -> None:
    assert gpu_layers(-1, visible_devices="", supports_offload=True, model="m", platform="darwin") == -1


def test_layer_placement_is_read_from_the_load_log() -> None:
    gpu_log = [f"load_tensors: layer {i:3d} assigned to device CUDA0, is_swa = 0\n" for i in range(3)]
    assert layer_placement(gpu_log) == LayerPlacement({"CUDA0": 3})
    split = [*gpu_log[:2], "load_tensors: layer   2 assigned to device CPU, is_swa = 0\n"]
    placement = layer_placement(split)
    assert placement is not None and (placement.offloaded, placement.total) == (2, 3)
    assert placement.describe() == "2/3 layers offloaded (CUDA0: 2), 1 on the CPU"
    assert layer_placement(["load_tensors: offloaded 30/33 layers to GPU\n"]) == LayerPlacement(
        {"GPU": 30, "CPU": 3}
    )
    assert layer_placement(["something else\n"]) is None


def test_an_offload_that_ended_on_the_cpu_is_refused() -> None:
    on_cpu = LayerPlacement({"CPU": 3})
    with pytest.raises(ConfigError, match=r"n_gpu_layers is -1, but llama\.cpp put all 3 layers on the CPU"):
        check_offload(-1, on_cpu, model="m", visible="0")
    check_offload(0, on_cpu, model="m", visible="0")
    check_offload(-1, LayerPlacement({"CUDA0": 3}), model="m", visible="0")
    check_offload(-1, None, model="m", visible="0")  # a log that says nothing: nothing to hold against it


@pytest.mark.skipif(not CPU_BUILD, reason="this llama-cpp-python build offloads to a GPU")
@pytest.mark.parametrize("visible", ["", "0"])
async def test_cpu_build_default_loads_every_layer_on_the_cpu(
    tiny_model: TinyModelPaths,
    started: list[LlamaCppBackend],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    visible: str,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # "0": as if placement gave the worker GPU 0
    with caplog.at_level(logging.INFO, logger="gengate.engines.llamacpp"):
        llm = await _start(started, tiny_model)
    assert llm.model_params.n_gpu_layers == 0 and llm.model_params.main_gpu == 0
    assert started[0].layer_placement == LayerPlacement({"CPU": LAYERS})  # read from llama.cpp's own log
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if visible:
        assert warned == [
            "model 'tiny' runs on the CPU although GPU(s) 0 were placed for it: this llama-cpp-python "
            "build has no GPU offload"
        ]
    else:
        assert warned == []
    result = await started[0].generate(
        GenerationRequest(model="tiny", prompt="Hi", stopping=StoppingCriteria(max_tokens=3))
    )
    assert result.usage.output_tokens == 3


@pytest.mark.skipif(not CPU_BUILD, reason="this llama-cpp-python build offloads to a GPU")
@pytest.mark.parametrize("layers", [-1, 2])
async def test_cpu_build_refuses_an_explicit_offload_at_start(
    tiny_model: TinyModelPaths, started: list[LlamaCppBackend], monkeypatch: pytest.MonkeyPatch, layers: int
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as info:
        await _start(started, tiny_model, n_gpu_layers=layers)
    assert str(info.value).startswith(
        f"model 'tiny': n_gpu_layers is {layers}, but this llama-cpp-python build has no GPU offload"
    )
    assert started[0]._llm is None  # refused before loading, not served on the CPU


# --- the other load options reach llama_cpp.Llama ------------------------------------------------


async def test_load_options_reach_llama(tiny_model: TinyModelPaths, started: list[LlamaCppBackend]) -> None:
    llm = await _start(started, tiny_model, n_ctx=256, n_batch=64, split_mode="row", flash_attn=True)
    assert llm.n_batch == llm.context_params.n_batch == 64
    assert llm.model_params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_ROW
    assert llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert llm.context_params.n_ctx == 256
    # a long prompt goes through in batches of 64 with flash attention on
    result = await started[0].generate(
        GenerationRequest(model="tiny", prompt="the cat sat " * 30, stopping=StoppingCriteria(max_tokens=4))
    )
    assert result.usage.input_tokens > 64 and result.usage.output_tokens == 4


async def test_load_defaults_reach_llama(tiny_model: TinyModelPaths, started: list[LlamaCppBackend]) -> None:
    llm = await _start(started, tiny_model, n_ctx=256)
    assert llm.n_batch == 256  # min(512, n_ctx)
    assert llm.model_params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_LAYER
    assert llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"n_gpu_layers": -2}, "n_gpu_layers: Input should be greater than or equal to -1"),
        ({"n_gpu_layers": True}, "n_gpu_layers: Input should be a valid integer"),
        ({"n_gpu_layers": "8"}, "n_gpu_layers: Input should be a valid integer"),
        ({"split_mode": "rows"}, "split_mode: Input should be 'none', 'layer' or 'row'"),
        ({"n_batch": 0}, "n_batch: Input should be greater than or equal to 1"),
        ({"n_batch": 4096}, "`n_batch` (4096) is larger than `n_ctx` (2048)"),
        ({"flash_attn": "on"}, "flash_attn: Input should be a valid boolean"),
        ({"chat_format": ""}, "chat_format: String should have at least 1 character"),
        (
            {"chat_format": "chatml", "chat_template": "{{x}}"},
            "set at most one of `chat_format` and `chat_template`",
        ),
        ({"n_gpu": 1}, "unknown key(s) ['n_gpu'] for backend 'llamacpp'"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(entry: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            {"models": [{"name": "m", "backend": "llamacpp", "tiny": True, **entry}]}, source="c.yaml"
        )
    assert str(info.value).startswith("c.yaml: models[0] (m): ")
    assert fragment in str(info.value)


# --- chat_format ----------------------------------------------------------------------------------


async def test_chat_format_renders_messages_and_adds_its_stop(
    tiny_model: TinyModelPaths, started: list[LlamaCppBackend]
) -> None:
    llm = await _start(started, tiny_model, chat_format="llama-2")
    assert llm.chat_format == "llama-2"  # passed through to llama-cpp-python too
    request = GenerationRequest(model="tiny", messages=MESSAGES, stopping=StoppingCriteria(max_tokens=4))
    result = await started[0].generate(request)
    rendered = "[INST] <<SYS>>\nBe brief.\n<</SYS>> Hi [/INST]"  # llama-cpp-python's llama-2 format
    assert result.usage.input_tokens == len(llm.tokenize(rendered.encode(), add_bos=True, special=True))
    assert result.effective_stopping.stop == ()  # llama-2 has no stop string

    await _start(started, tiny_model, chat_format="snoozy")
    snoozy = started[1]
    chat = await snoozy.generate(request)
    assert chat.effective_stopping.stop == ("###",)  # snoozy's, as create_chat_completion adds it
    with_own = await snoozy.generate(
        GenerationRequest(
            model="tiny", messages=MESSAGES, stopping=StoppingCriteria(max_tokens=4, stop=("zz",))
        )
    )
    assert with_own.effective_stopping.stop == ("zz", "###")
    prompt = await snoozy.generate(
        GenerationRequest(model="tiny", prompt="Hi", stopping=StoppingCriteria(max_tokens=4))
    )
    assert prompt.effective_stopping.stop == ()  # a raw prompt is not in the chat format


async def test_chat_format_stop_ends_the_generation(
    tiny_model: TinyModelPaths, started: list[LlamaCppBackend]
) -> None:
    """pygmalion stops at a newline: a generation long enough to write one ends there."""
    await _start(started, tiny_model, chat_format="pygmalion")
    result = await started[0].generate(
        GenerationRequest(
            model="tiny",
            messages=MESSAGES,
            stopping=StoppingCriteria(max_tokens=200),
            n=4,
            sampling=SamplingParams(seed=1),  # seeded: which samples write a newline is fixed
        )
    )
    assert "\n" in result.effective_stopping.stop  # the format's stop string is in force
    generations = result.generations
    stopped = [g for g in generations if g.finish_reason is FinishReason.STOP_SEQUENCE]
    assert stopped, [g.text for g in generations]
    assert all(g.matched_stop == "\n" and "\n" not in g.text for g in stopped)


async def test_chat_format_of_the_gguf_template_renders_as_the_template(
    tiny_model: TinyModelPaths, started: list[LlamaCppBackend]
) -> None:
    await _start(started, tiny_model)
    await _start(started, tiny_model, chat_format="chat_template.default")
    request = GenerationRequest(model="tiny", messages=MESSAGES, stopping=StoppingCriteria(max_tokens=1))
    template, named = [await b.generate(request) for b in started]
    assert named.usage.input_tokens == template.usage.input_tokens


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("chatml2", "chat_format 'chatml2' is not a llama-cpp-python chat format (known: alpaca, "),
        ("functionary", "chat_format 'functionary' is a llama-cpp-python completion handler"),
        (
            "chat_template.tool_use",
            "chat_format 'chat_template.tool_use' is not among this model's chat formats",
        ),
    ],
)
async def test_unknown_chat_format_is_refused_at_start(
    tiny_model: TinyModelPaths, started: list[LlamaCppBackend], name: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        await _start(started, tiny_model, chat_format=name)
    assert str(info.value).startswith(f"model 'tiny': {fragment}")
    assert "chatml" in str(info.value)  # the names that would do
    assert started[0]._llm is None
