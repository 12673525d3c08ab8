"""Chat-template variables (chat_template_kwargs, reasoning.enabled as `enable_thinking`) on the
local engines with the tiny model and a template that writes what it was given into the prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from gengate import errors
from gengate.backend import Backend
from gengate.domain import (
    ChatMessage,
    GenerationRequest,
    ReasoningControl,
    ReasoningEffort,
    Role,
    SamplingParams,
    StoppingCriteria,
    TextPart,
)
from gengate.engines.chat_vars import RESERVED_VARIABLES
from gengate.models.tiny import TinyModelPaths
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from observe import field_violations, reason

# Writes, after the generation prompt, whether it was asked to think and a variable of the caller's.
SWITCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% else %}[think]{% endif %}"
    "{% if flavour is defined %}[flavour={{ flavour }}]{% endif %}{% endif %}"
)


def _llamacpp(model: TinyModelPaths, template: str | None) -> tuple[Backend, Callable[[Any, Any], str]]:
    pytest.importorskip("llama_cpp")
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    options = LlamaCppOptions(path=str(model.gguf_path), n_ctx=512, n_threads=1, chat_template=template)
    backend = LlamaCppBackend("tiny", options)

    def rendered(engine: Any, request: GenerationRequest) -> str:
        tokens = engine._prompt_tokens(request)
        return str(engine._llm.detokenize(tokens, special=True).decode())

    return backend, rendered


def _transformers(model: TinyModelPaths, template: str | None) -> tuple[Backend, Callable[[Any, Any], str]]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gengate.engines.transformers import TransformersBackend, TransformersOptions

    options = TransformersOptions(model=str(model.hf_dir), max_batch_size=4, chat_template=template)
    backend = TransformersBackend("tiny", options)

    def rendered(engine: Any, request: GenerationRequest) -> str:
        loaded = engine._loaded
        return str(loaded.tokenizer.decode(engine._prompt_ids(loaded, request)))

    return backend, rendered


def _mlx(model: TinyModelPaths, template: str | None) -> tuple[Backend, Callable[[Any, Any], str]]:
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from gengate.engines.mlx import MlxBackend, MlxOptions

    backend = MlxBackend(
        "tiny", MlxOptions(model=str(model.hf_dir), max_batch_size=4, chat_template=template)
    )

    def rendered(engine: Any, request: GenerationRequest) -> str:
        loaded = engine._loaded
        return str(loaded.tokenizer.decode(engine._prompt_ids(loaded, request)))

    return backend, rendered


ENGINES = {"llamacpp": _llamacpp, "transformers": _transformers, "mlx": _mlx}


@pytest.fixture(scope="module", params=list(ENGINES))
async def engine(
    request: pytest.FixtureRequest, tiny_model: TinyModelPaths
) -> AsyncIterator[tuple[Backend, Callable[[Any, Any], str]]]:
    backend, rendered = ENGINES[request.param](tiny_model, SWITCH_TEMPLATE)
    await backend.start()
    yield backend, rendered
    await backend.aclose()


def chat(**fields: Any) -> GenerationRequest:
    fields.setdefault("messages", (ChatMessage(Role.USER, (TextPart("Hello?"),)),))
    return GenerationRequest(
        model="tiny", sampling=SamplingParams(seed=1), stopping=StoppingCriteria(max_tokens=4), **fields
    )


def violated(exc: errors.GengateError) -> list[str]:
    return [v.field for v in exc.violations]


async def test_a_template_engine_declares_variables_and_the_thinking_switch(engine: Any) -> None:
    backend, _ = engine
    assert backend.capabilities.chat_template_kwargs
    assert backend.capabilities.reasoning_control  # the template reads enable_thinking


async def test_the_variables_reach_the_template(engine: Any) -> None:
    backend, rendered = engine
    plain = rendered(backend, chat())
    assert plain.endswith("[think]") and "[flavour=" not in plain
    given = rendered(backend, chat(chat_template_kwargs={"enable_thinking": False, "flavour": "mint"}))
    assert given.endswith("[no-think][flavour=mint]")
    result = await backend.generate(chat(chat_template_kwargs={"flavour": "a long flavour name here"}))
    baseline = await backend.generate(chat())
    assert result.usage.input_tokens > baseline.usage.input_tokens  # the variable went into the prompt


async def test_reasoning_enabled_becomes_enable_thinking(engine: Any) -> None:
    backend, rendered = engine
    assert rendered(backend, chat(reasoning=ReasoningControl(enabled=False))).endswith("[no-think]")
    assert rendered(backend, chat(reasoning=ReasoningControl(enabled=True))).endswith("[think]")
    agreeing = chat(
        reasoning=ReasoningControl(enabled=False), chat_template_kwargs={"enable_thinking": False}
    )
    assert rendered(backend, agreeing).endswith("[no-think]")
    with pytest.raises(errors.InvalidArgument) as caught:
        rendered(
            backend,
            chat(reasoning=ReasoningControl(enabled=True), chat_template_kwargs={"enable_thinking": False}),
        )
    assert violated(caught.value) == ["chat_template_kwargs_json.enable_thinking"]


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
async def test_a_variable_the_engine_sets_is_refused_by_name(engine: Any, key: str) -> None:
    backend, _ = engine
    assert key in RESERVED_VARIABLES
    with pytest.raises(errors.InvalidArgument) as caught:
        await backend.generate(chat(chat_template_kwargs={key: "x", "flavour": "ok"}))
    assert violated(caught.value) == [f"chat_template_kwargs_json.{key}"]


async def test_variables_with_a_raw_prompt_are_refused(engine: Any) -> None:
    backend, _ = engine
    with pytest.raises(errors.InvalidArgument) as caught:
        await backend.generate(chat(messages=None, prompt="Hi", chat_template_kwargs={"flavour": "x"}))
    assert violated(caught.value) == ["chat_template_kwargs_json"]


async def test_effort_is_refused_on_a_local_engine(engine: Any) -> None:
    backend, _ = engine
    with pytest.raises(errors.Unimplemented) as caught:
        await backend.generate(chat(reasoning=ReasoningControl(effort=ReasoningEffort.LOW)))
    assert caught.value.reason == "REASONING_UNSUPPORTED"
    assert violated(caught.value) == ["reasoning.effort"]


async def test_the_tiny_models_own_template_has_no_thinking_switch(tiny_model: TinyModelPaths) -> None:
    backend, _ = _transformers(tiny_model, None)
    await backend.start()
    try:
        assert backend.capabilities.chat_template_kwargs and not backend.capabilities.reasoning_control
        with pytest.raises(errors.Unimplemented) as caught:
            await backend.generate(chat(reasoning=ReasoningControl(enabled=False)))
        assert violated(caught.value) == ["reasoning.enabled"]
    finally:
        await backend.aclose()


async def test_the_server_passes_variables_and_refuses_them_where_no_template_renders(
    make_server: Callable[[dict[str, Any]], Any], tiny_model: TinyModelPaths
) -> None:
    pytest.importorskip("llama_cpp")
    gguf = str(tiny_model.gguf_path)
    server = await make_server(
        {
            "models": [
                {
                    "name": "switch",
                    "backend": "llamacpp",
                    "path": gguf,
                    "n_ctx": 512,
                    "chat_template": SWITCH_TEMPLATE,
                },
                {
                    "name": "formatted",
                    "backend": "llamacpp",
                    "path": gguf,
                    "n_ctx": 512,
                    "chat_format": "chatml",
                },
            ]
        }
    )
    messages = t.ChatMessages(messages=[t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart(text="Hi")])])

    def ask(model: str, variables: str) -> g.GenerateRequest:
        return g.GenerateRequest(
            model=model,
            messages=messages,
            chat_template_kwargs_json=variables,
            stopping=t.StoppingCriteria(max_tokens=2),
        )

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        reply = await stub.Generate(ask("switch", '{"flavour": "mint"}'))
        assert len(reply.generations) == 1
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(ask("switch", '{"bos_token": "<s>"}'))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(caught.value) == ["chat_template_kwargs_json.bos_token"]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(ask("formatted", '{"flavour": "mint"}'))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert reason(caught.value) == "CHAT_TEMPLATE_KWARGS_UNSUPPORTED"
        assert field_violations(caught.value) == ["chat_template_kwargs_json"]


class _FakeTokenizer:
    """What vllm_prompt_ids reads of vLLM's tokenizer; records the template's arguments."""

    chat_template = "{{ enable_thinking }}"
    bos_token_id = 1

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> list[int]:
        self.calls.append(kwargs)
        return [1, 2, 3]


def test_vllm_passes_the_variables_and_the_thinking_switch_to_apply_chat_template() -> None:
    from gengate.engines.vllm_prompt import vllm_prompt_ids

    tokenizer = _FakeTokenizer()
    ids = vllm_prompt_ids(
        tokenizer,
        chat(reasoning=ReasoningControl(enabled=False), chat_template_kwargs={"flavour": "x"}),
        None,
    )
    assert ids == [1, 2, 3]
    (call,) = tokenizer.calls
    assert call["flavour"] == "x" and call["enable_thinking"] is False and call["add_generation_prompt"]
    with pytest.raises(errors.InvalidArgument) as caught:
        vllm_prompt_ids(tokenizer, chat(chat_template_kwargs={"tokenize": False}), None)
    assert violated(caught.value) == ["chat_template_kwargs_json.tokenize"]
