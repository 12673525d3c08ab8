"""The vLLM engine's pure mapping logic, tested without vLLM installed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from gengate import errors
from gengate.config import parse_config
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
    Whitespace,
)
from gengate.engines.vllm import (
    OWN_ENGINE_ARGS,
    OutputTracker,
    VLLMBackend,
    VLLMOptions,
    capabilities_for,
    checked_engine_args,
    convert_logprobs,
    engine_arg_names,
    engine_kwargs,
    finish_reason_of,
    lora_choice,
    lora_slots,
    no_lora_adapter,
    sampling_kwargs,
    structured_outputs_kwargs,
)
from gengate.models.tiny import TinyModelPaths


def test_module_does_not_import_vllm() -> None:
    assert "vllm" not in sys.modules


def test_sampling_mapping_sets_only_what_the_request_sets() -> None:
    request = GenerationRequest(
        model="m",
        prompt="p",
        n=2,
        sampling=SamplingParams(temperature=0.7, top_k=40, seed=11, presence_penalty=0.5),
        stopping=StoppingCriteria(max_tokens=32, stop=("\n\n", "END")),
        logprobs=3,
    )
    assert sampling_kwargs(request, default_max_tokens=1000) == {
        "n": 2,
        "temperature": 0.7,
        "top_k": 40,
        "seed": 11,
        "presence_penalty": 0.5,
        "max_tokens": 32,
        "stop": ["\n\n", "END"],
        "include_stop_str_in_output": False,
        "logprobs": 3,
    }


def test_engine_options_map_to_vllms_own_and_bad_ones_are_refused() -> None:
    request = GenerationRequest(model="m", prompt="p", backend_options={"min_tokens": 5, "ignore_eos": True})
    kwargs = sampling_kwargs(request, default_max_tokens=100)
    assert (kwargs["min_tokens"], kwargs["ignore_eos"]) == (5, True)
    with pytest.raises(errors.InvalidArgument) as info:
        sampling_kwargs(
            GenerationRequest(model="m", prompt="p", backend_options={"ignore_eos": "yes"}),
            default_max_tokens=9,
        )
    assert info.value.violations[0].field == "backend_options[ignore_eos]"
    assert capabilities_for(VLLMOptions(model="x"), context_length=8, chat=True).backend_options == {
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
    }


def test_unset_max_tokens_uses_the_rest_of_the_context_not_vllms_16() -> None:
    kwargs = sampling_kwargs(GenerationRequest(model="m", prompt="p"), default_max_tokens=4000)
    assert kwargs == {"n": 1, "max_tokens": 4000}


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (StructuredOutput(RegexConstraint(r"\d+")), {"regex": "[0-9]+"}),  # ASCII dialect
        (StructuredOutput(ChoiceConstraint(("a", "b"))), {"choice": ["a", "b"]}),
        (StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, "start: /x/")), {"grammar": "start: /x/"}),
        # compact whitespace comes from the engine; flexible is asked for in the schema itself
        (StructuredOutput(JsonObjectConstraint()), {"json": {"type": "object"}}),
        (
            StructuredOutput(JsonObjectConstraint(), whitespace=Whitespace.FLEXIBLE),
            {"json": {"type": "object", "x-guidance": {"whitespace_flexible": True}}},
        ),
    ],
)
def test_structured_outputs_mapping(output: StructuredOutput, expected: dict[str, Any]) -> None:
    assert structured_outputs_kwargs(output) == (expected, Enforcement.ENGINE)


def test_json_schema_goes_through_gengates_lowering() -> None:
    """Closed objects by default, ASCII patterns, compact whitespace: what the other engines do."""
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": r"^\d+$"}}}
    kwargs, enforcement = structured_outputs_kwargs(StructuredOutput(JsonSchemaConstraint(schema)))
    assert enforcement is Enforcement.ENGINE
    assert kwargs == {
        "json": {
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}},
            "additionalProperties": False,
        }
    }
    assert schema["properties"]["id"]["pattern"] == r"^\d+$"  # the caller's schema is untouched
    opened, _ = structured_outputs_kwargs(
        StructuredOutput(
            JsonSchemaConstraint(schema), additional_properties=True, whitespace=Whitespace.FLEXIBLE
        )
    )
    assert opened["json"]["additionalProperties"] is True
    assert opened["json"]["x-guidance"] == {"whitespace_flexible": True}


def test_schema_the_engine_cannot_enforce_is_relaxed_and_validated() -> None:
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    kwargs, enforcement = structured_outputs_kwargs(StructuredOutput(JsonSchemaConstraint(unique)))
    assert enforcement is Enforcement.VALIDATED
    assert kwargs["json"] == {"type": "array", "items": {"type": "integer"}}


def test_bad_schema_is_a_field_error() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        structured_outputs_kwargs(StructuredOutput(JsonSchemaConstraint({"type": "no-such-type"})))
    assert info.value.violations[0].field == "structured_output.json_schema.schema"


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        ("stop", None, (FinishReason.STOP, None)),
        ("stop", 2, (FinishReason.STOP, None)),  # an EOS / stop token id
        ("stop", "END", (FinishReason.STOP_SEQUENCE, "END")),
        ("length", None, (FinishReason.LENGTH, None)),
        ("abort", None, (FinishReason.CANCELLED, None)),
        ("error", None, (FinishReason.ERROR, None)),
    ],
)
def test_finish_reasons(reason: str, stop_reason: object, expected: tuple[FinishReason, str | None]) -> None:
    assert finish_reason_of(reason, stop_reason) == expected  # type: ignore[arg-type]


def _lp(logprob: float, rank: int, token: str) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def test_logprobs_conversion() -> None:
    converted = convert_logprobs(
        [5, 9],
        [{5: _lp(-0.1, 1, "a"), 6: _lp(-2.5, 2, "b")}, {7: _lp(-0.2, 1, "c"), 9: _lp(-1.0, 2, "d")}],
        top=1,
    )
    assert converted is not None
    assert [(t.token, t.logprob, t.token_id) for t in converted] == [("a", -0.1, 5), ("d", -1.0, 9)]
    assert [[(x.token, x.token_id) for x in t.top] for t in converted] == [[("a", 5)], [("c", 7)]]
    assert convert_logprobs([1], None, top=2) is None


def _completion(index: int, text: str, ids: list[int], finish: str | None = None, stop: Any = None) -> Any:
    return SimpleNamespace(
        index=index, text=text, token_ids=ids, logprobs=None, finish_reason=finish, stop_reason=stop
    )


def test_tracker_turns_delta_outputs_into_events_with_usage() -> None:
    tracker = OutputTracker(input_tokens=7, top_logprobs=0)
    outputs = [
        SimpleNamespace(
            outputs=[_completion(0, "Hel", [1, 2]), _completion(1, "Yo", [3])], num_cached_tokens=4
        ),
        SimpleNamespace(outputs=[_completion(0, "lo", [4], "stop", "\n")]),
        SimpleNamespace(outputs=[_completion(1, "", [], "length")]),
    ]
    events = [event for output in outputs for event in tracker.feed(output)]
    assert not any(isinstance(e, GenerationDelta) and e.text == "" for e in events)
    deltas = [(e.index, e.text, e.token_count) for e in events if isinstance(e, GenerationDelta)]
    assert deltas == [(0, "Hel", 2), (1, "Yo", 1), (0, "lo", 1)]
    ends = {e.index: e for e in events if isinstance(e, GenerationEnd)}
    assert ends[0].finish_reason is FinishReason.STOP_SEQUENCE and ends[0].matched_stop == "\n"
    assert ends[0].usage.input_tokens == 7 and ends[0].usage.output_tokens == 3
    assert ends[0].usage.cached_input_tokens == ends[1].usage.cached_input_tokens == 4
    assert ends[1].finish_reason is FinishReason.LENGTH and ends[1].usage.output_tokens == 1
    assert tracker.finished(2) and not OutputTracker(1, 0).finished(1)


def test_tensor_parallel_size_follows_the_placed_gpus() -> None:
    options = VLLMOptions(model="m")
    assert engine_kwargs(options, visible_devices="2,5")["tensor_parallel_size"] == 2
    assert engine_kwargs(options, visible_devices="0")["enable_prefix_caching"] is True
    assert (
        engine_kwargs(VLLMOptions(model="m", tensor_parallel_size=4), visible_devices="0,1")[
            "tensor_parallel_size"
        ]
        == 4
    )
    multi_node = VLLMOptions(model="m", pipeline_parallel_size=2, distributed_executor_backend="ray")
    kwargs = engine_kwargs(multi_node, visible_devices="0,1,2,3")
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
    assert kwargs["distributed_executor_backend"] == "ray"
    assert "max_model_len" not in kwargs  # unset options keep vLLM's defaults


def test_no_gpu_is_a_clear_start_error() -> None:
    with pytest.raises(errors.Unavailable, match="vLLM needs a GPU"):
        engine_kwargs(VLLMOptions(model="m"), visible_devices="")
    # Not placed by gengate (inline): one GPU unless tensor_parallel_size says otherwise.
    assert engine_kwargs(VLLMOptions(model="m"), visible_devices=None)["tensor_parallel_size"] == 1


def test_cpu_build_runs_only_in_a_cpu_worker() -> None:
    options = VLLMOptions(model="m", tensor_parallel_size=4)
    kwargs = engine_kwargs(options, visible_devices="", cpu_platform=True)
    assert kwargs["tensor_parallel_size"] == 1 and "gpu_memory_utilization" not in kwargs
    assert engine_kwargs(options, visible_devices=None, cpu_platform=True)["tensor_parallel_size"] == 1
    with pytest.raises(errors.ConfigError, match="set 'devices: cpu'"):
        engine_kwargs(options, visible_devices="0", cpu_platform=True)


def test_capabilities_declare_every_constraint_kind() -> None:
    caps = capabilities_for(VLLMOptions(model="m"), context_length=4096, chat=True)
    assert set(caps.constraints) == set(ConstraintKind)
    assert set(caps.constraints.values()) == {Enforcement.ENGINE}
    assert caps.grammar_syntaxes == {GrammarSyntax.LARK, GrammarSyntax.GBNF}
    assert caps.max_n == 16 and caps.logprobs and caps.seed and caps.context_length == 4096


def test_config_accepts_vllm_models_without_vllm_installed() -> None:
    config = parse_config(
        {
            "models": [
                {"name": "big", "backend": "vllm", "model": "/models/x", "num_gpus": 2, "max_model_len": 8192}
            ]
        }
    ).models[0]
    assert isinstance(config.options, VLLMOptions) and config.num_gpus == 2


async def test_start_without_vllm_installed_names_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(errors.ConfigError, match=r"Dockerfile\.vllm"):
        await VLLMBackend("big", VLLMOptions(model="m")).start()


def test_final_only_output_is_one_delta_per_generation_without_ttft() -> None:
    tracker = OutputTracker(input_tokens=3, top_logprobs=0, final_only=True)
    final = SimpleNamespace(
        outputs=[_completion(0, "whole text", [1, 2, 3], "length"), _completion(1, "ab", [4], "stop")]
    )
    events = list(tracker.feed(final))
    assert [(e.index, e.text) for e in events if isinstance(e, GenerationDelta)] == [
        (0, "whole text"),
        (1, "ab"),
    ]
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert [e.usage.output_tokens for e in ends] == [3, 1]
    assert all(e.timings.time_to_first_token_s is None and e.timings.total_s is not None for e in ends)
    assert tracker.finished(2)


def test_lowered_schemas_are_cached_by_content() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first, _ = structured_outputs_kwargs(StructuredOutput(JsonSchemaConstraint(schema)))
    again, _ = structured_outputs_kwargs(StructuredOutput(JsonSchemaConstraint(dict(schema))))
    assert again["json"] is first["json"]  # lowered once
    other, _ = structured_outputs_kwargs(
        StructuredOutput(JsonSchemaConstraint(schema), additional_properties=True)
    )
    assert other["json"] is not first["json"] and other["json"]["additionalProperties"] is True


def test_lora_adapters_enable_lora_and_are_picked_by_name() -> None:
    options = VLLMOptions(model="m", lora_adapters={"sql": "~/a/sql", "chat": "/a/chat"}, max_lora_rank=32)
    kwargs = engine_kwargs(options, visible_devices="0")
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 32, 4)
    assert "enable_lora" not in engine_kwargs(VLLMOptions(model="m"), visible_devices="0")
    caps = capabilities_for(options, context_length=8, chat=True)
    assert caps.backend_options == {
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "lora",
    }

    def pick(value: object) -> str | None:
        request = GenerationRequest(model="m", prompt="p", backend_options={"lora": value} if value else {})
        return lora_choice(request, options.lora_adapters)

    assert pick(None) is None and pick("sql") == "sql"
    slots = lora_slots(options.lora_adapters)
    assert slots["chat"] == (1, "/a/chat")  # ids by sorted name, from 1
    assert slots["sql"][0] == 2 and not slots["sql"][1].startswith("~")
    for bad, message in (
        (3, "must be a string, got int"),
        ("nope", "no adapter 'nope' on this model (adapters: chat, sql)"),
    ):
        with pytest.raises(errors.InvalidArgument) as info:
            pick(bad)
        assert info.value.violations[0].field == "backend_options[lora]" and message in info.value.message
    # lora is vLLM's own key: the shared option check leaves it to the engine
    request = GenerationRequest(model="m", prompt="p", backend_options={"lora": "sql", "min_tokens": 2})
    assert sampling_kwargs(request, default_max_tokens=9)["min_tokens"] == 2


def test_cpu_build_serves_requests_without_an_adapter_with_one_that_changes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from gengate.models.tiny import TINY_VLLM, build_tiny_lora
    from safetensors.torch import load_file

    adapters = {"b": str(build_tiny_lora(tmp_path / "b", config=TINY_VLLM)), "a": str(tmp_path / "missing")}
    options = VLLMOptions(model="m", lora_adapters=adapters, max_loras=2)
    assert engine_kwargs(options, visible_devices="", cpu_platform=True)["max_loras"] == 3  # + its slot
    assert engine_kwargs(options, visible_devices="0")["max_loras"] == 2
    with pytest.raises(errors.ConfigError, match="adapter 'a'"):  # the first by name is the model
        no_lora_adapter(adapters, tmp_path / "none")
    made = no_lora_adapter({"b": adapters["b"]}, tmp_path / "none")
    source, zeroed = (
        load_file(f"{adapters['b']}/adapter_model.safetensors"),
        load_file(f"{made}/adapter_model.safetensors"),
    )
    assert source.keys() == zeroed.keys()
    for key, tensor in zeroed.items():
        if "lora_B" in key:
            assert not tensor.any() and source[key].any()
        else:
            assert (tensor == source[key]).all()
    assert (made / "adapter_config.json").read_text() == (tmp_path / "b" / "adapter_config.json").read_text()


# --- issue 12: engine settings and per-request sampling options -----------------------------------


def test_vllm_sampling_options_reach_sampling_params() -> None:
    request = GenerationRequest(
        model="m",
        prompt="p",
        stopping=StoppingCriteria(max_tokens=8, stop=("END",)),
        backend_options={
            "stop_token_ids": "2, 7,11",
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        },
    )
    kwargs = sampling_kwargs(request, default_max_tokens=100, vocab_size=50)
    assert kwargs["stop_token_ids"] == [2, 7, 11]
    assert kwargs["skip_special_tokens"] is False
    assert kwargs["include_stop_str_in_output"] is True  # over the False gengate sets with stop strings
    one = GenerationRequest(model="m", prompt="p", backend_options={"stop_token_ids": 5})
    assert sampling_kwargs(one, default_max_tokens=100)["stop_token_ids"] == [5]
    plain = sampling_kwargs(GenerationRequest(model="m", prompt="p"), default_max_tokens=100)
    assert not {"stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"} & set(plain)


@pytest.mark.parametrize(
    ("options", "structured", "field", "text"),
    [
        ({"stop_token_ids": "2,x"}, False, "stop_token_ids", "must be token ids separated by commas"),
        ({"stop_token_ids": ""}, False, "stop_token_ids", "must be token ids separated by commas"),
        ({"stop_token_ids": "-1"}, False, "stop_token_ids", "must be token ids separated by commas"),
        (
            {"stop_token_ids": True},
            False,
            "stop_token_ids",
            "an int or a comma-separated string of ints, got bool",
        ),
        ({"stop_token_ids": 1.5}, False, "stop_token_ids", "got float"),
        (
            {"stop_token_ids": "3,50"},
            False,
            "stop_token_ids",
            "token id 50 is not in the vocabulary (the vocabulary has 50)",
        ),
        ({"stop_token_ids": -4}, False, "stop_token_ids", "token id -4 is not in the vocabulary"),
        ({"skip_special_tokens": 1}, False, "skip_special_tokens", "must be a bool, got int"),
        (
            {"include_stop_str_in_output": "yes"},
            False,
            "include_stop_str_in_output",
            "must be a bool, got str",
        ),
        (
            {"include_stop_str_in_output": True},
            True,
            "include_stop_str_in_output",
            "does not go with structured_output",
        ),
    ],
)
def test_bad_vllm_sampling_options_name_the_option(
    options: dict[str, Any], structured: bool, field: str, text: str
) -> None:
    request = GenerationRequest(
        model="m",
        prompt="p",
        backend_options=options,
        structured_output=StructuredOutput(RegexConstraint("a+")) if structured else None,
    )
    with pytest.raises(errors.InvalidArgument) as info:
        sampling_kwargs(request, default_max_tokens=10, vocab_size=50)
    assert [v.field for v in info.value.violations] == [f"backend_options[{field}]"]
    assert text in info.value.message


def test_vllm_sampling_options_are_declared_so_others_stay_refused() -> None:
    from gengate.checks import prepare

    caps = capabilities_for(VLLMOptions(model="m"), context_length=64, chat=True)
    ok = GenerationRequest(model="m", prompt="p", backend_options={"stop_token_ids": "3"})
    assert prepare(ok, caps).backend_options == {"stop_token_ids": "3"}
    with pytest.raises(errors.InvalidArgument) as info:
        prepare(GenerationRequest(model="m", prompt="p", backend_options={"stop_token_id": "3"}), caps)
    assert [v.field for v in info.value.violations] == ["backend_options[stop_token_id]"]
    with_lora = capabilities_for(
        VLLMOptions(model="m", lora_adapters={"a": "/x"}), context_length=64, chat=True
    )
    assert with_lora.backend_options == caps.backend_options | {"lora"}


def test_tokenizer_mode_revision_and_quantization_reach_the_engine_args() -> None:
    options = VLLMOptions(model="org/model", tokenizer_mode="mistral", revision="v2", quantization="awq")
    kwargs = engine_kwargs(options, visible_devices="0")
    assert (kwargs["tokenizer_mode"], kwargs["revision"], kwargs["quantization"]) == ("mistral", "v2", "awq")
    assert "tokenizer_mode" not in engine_kwargs(VLLMOptions(model="m"), visible_devices="0")


def test_revision_of_a_local_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match=r"'revision' applies to a hub id"):
        parse_config({"models": [{"name": "v", "backend": "vllm", "model": str(tmp_path), "revision": "v1"}]})


def test_extra_engine_args_may_not_set_what_gengate_sets() -> None:
    entry = {
        "name": "v",
        "backend": "vllm",
        "model": "m",
        "extra_engine_args": {"tensor_parallel_size": 2, "enable_lora": True, "block_size": 32},
    }
    with pytest.raises(errors.ConfigError) as info:
        parse_config({"models": [entry]})
    assert (
        "models[0] (v): extra_engine_args: Value error, "
        "'enable_lora' is set by gengate from `lora_adapters`; "
        "'tensor_parallel_size' is set by gengate from `tensor_parallel_size (or the GPUs placed: num_gpus)`"
    ) in str(info.value)
    entry["extra_engine_args"] = {"block_size": 32}
    options = parse_config({"models": [entry]}).models[0].options
    assert isinstance(options, VLLMOptions) and options.extra_engine_args == {"block_size": 32}


def test_own_engine_args_cover_everything_gengate_sets() -> None:
    """A new engine_kwargs key without its OWN_ENGINE_ARGS row would let extra_engine_args set it twice."""
    everything = VLLMOptions(
        model="m",
        tokenizer="t",
        revision="r",
        tokenizer_mode="slow",
        quantization="awq",
        max_model_len=64,
        tensor_parallel_size=1,
        distributed_executor_backend="mp",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        lora_adapters={"a": "/x"},
    )
    produced = set(engine_kwargs(everything, visible_devices="0")) | {"structured_outputs_config"}
    assert produced <= set(OWN_ENGINE_ARGS), produced - set(OWN_ENGINE_ARGS)


def test_extra_engine_args_are_checked_against_the_engine_args_fields() -> None:
    from dataclasses import dataclass, field

    @dataclass
    class StandInEngineArgs:  # shaped like vllm.AsyncEngineArgs: a dataclass of fields
        model: str = "m"
        block_size: int = 16
        swap_space: float = 4.0
        derived: int = field(default=0, init=False)

    known = engine_arg_names(StandInEngineArgs)
    assert known == {"model", "block_size", "swap_space"}
    assert checked_engine_args({"block_size": 32}, known, model="v") == {"block_size": 32}
    with pytest.raises(errors.ConfigError) as info:
        checked_engine_args({"blok_size": 32, "derived": 1, "zzz": 0}, known, model="v")
    assert str(info.value) == (
        "model 'v': extra_engine_args 'blok_size' (did you mean 'block_size'?), 'derived', 'zzz' "
        "are not fields of the installed vLLM's AsyncEngineArgs"
    )

    class PlainArgs:
        def __init__(self, model: str, *, block_size: int = 16, **rest: object) -> None: ...

    assert engine_arg_names(PlainArgs) == {"model", "block_size"}


# --- issue 14: tool calls, through the local engines' shared format ------------------------------


def test_tools_are_declared_for_the_guidance_backend_only() -> None:
    assert capabilities_for(VLLMOptions(model="m"), context_length=8, chat=True).tools is Enforcement.ENGINE
    xgrammar = VLLMOptions(model="m", structured_outputs_backend="xgrammar")
    assert capabilities_for(xgrammar, context_length=8, chat=True).tools is None  # no Lark `%json` there


def test_tools_reach_the_prompt_and_the_grammar(tiny_model: TinyModelPaths) -> None:
    pytest.importorskip("transformers")
    from gengate.domain import ChatMessage, Role, TextPart, Tool, ToolChoice, ToolChoiceMode
    from gengate.engines.toolcalls import tool_plan
    from transformers import AutoTokenizer

    backend = VLLMBackend("m", VLLMOptions(model="m", max_model_len=2048))
    backend._tokenizer = AutoTokenizer.from_pretrained(str(tiny_model.hf_dir))
    tool = Tool("lookup", "Looks a word up", {"type": "object", "properties": {"word": {"type": "string"}}})
    request = GenerationRequest(
        model="m",
        messages=(ChatMessage(Role.USER, (TextPart("hi"),)),),
        tools=(tool,),
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
    )
    prompt = backend._tokenizer.decode(backend._prompt_ids(request))
    assert "<|im_start|>system\n# Tools" in prompt and '"name": "lookup"' in prompt  # the generic form
    plan = tool_plan(request)
    assert plan is not None and plan.grammar is not None
    kwargs, _ = structured_outputs_kwargs(plan.grammar)  # what _sampling_params sends for tools
    assert kwargs == {"grammar": plan.grammar.constraint.definition}  # type: ignore[union-attr]
    assert "%json" in kwargs["grammar"]
