"""GengateLLM's mapping, without a server: each distilabel generation kwarg onto its gengate request
field (checked on the GenerateRequest proto the client sends), structured outputs, Magpie turns,
refusals named clearly, and gengate responses into distilabel's GenerateOutput."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from gengate_client import _convert as convert
from gengate_client.distilabel import GENGATE_FIELDS, GenerationKwargs, GengateCall, GengateLLM
from gengate_proto.v1 import generation_pb2, types_pb2
from pydantic import BaseModel, Field, ValidationError

pytestmark = pytest.mark.distilabel

USER = [{"role": "user", "content": "Name a city."}]


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0)


def llm(**fields: Any) -> GengateLLM:
    return GengateLLM(model="tiny", address="127.0.0.1:1", **fields)


def sent(call: GengateCall, model: str = "tiny") -> generation_pb2.GenerateRequest:
    """The GenerateRequest the client would send for this call."""
    pb, _ = convert.build_request(convert.as_request({"model": model, **call.generate_kwargs()}))
    return pb


def test_each_distilabel_kwarg_sets_its_gengate_field() -> None:
    generation = GenerationKwargs(
        max_new_tokens=17,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        repetition_penalty=1.1,
        stop_sequences=["END", "STOP"],
        seed=42,
        logprobs=True,
        top_logprobs=3,
        backend_options={"min_tokens": 2},
    )
    pb = sent(llm().build_call(USER, 3, generation))
    assert pb.n == 3
    assert pb.stopping.max_tokens == 17 and list(pb.stopping.stop) == ["END", "STOP"]
    assert pb.sampling.temperature == pytest.approx(0.5) and pb.sampling.top_p == pytest.approx(0.9)
    assert pb.sampling.top_k == 40 and pb.sampling.min_p == pytest.approx(0.05)
    assert pb.sampling.frequency_penalty == pytest.approx(0.1)
    assert pb.sampling.presence_penalty == pytest.approx(0.2)
    assert pb.sampling.repetition_penalty == pytest.approx(1.1)
    assert pb.sampling.seed == 42
    assert pb.HasField("logprobs") and pb.logprobs == 3
    assert pb.backend_options["min_tokens"].int_value == 2
    assert [(m.role, m.content[0].text) for m in pb.messages.messages] == [
        (types_pb2.ROLE_USER, "Name a city.")
    ]
    # Every field GENGATE_FIELDS names was checked above; a new entry needs a line here.
    assert set(GENGATE_FIELDS) == {f for f in generation.__dataclass_fields__ if "logprobs" not in f}


def test_unset_kwargs_are_left_to_the_server_defaults() -> None:
    pb = sent(llm().build_call("Once upon a time"))
    assert pb.prompt == "Once upon a time" and pb.n == 1
    assert pb.stopping.max_tokens == 128  # distilabel's default for every LLM
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        assert not pb.sampling.HasField(name), name
    assert not pb.HasField("logprobs") and not pb.HasField("structured_output")


def test_stop_sequences_as_one_string_and_logprobs_without_alternatives() -> None:
    pb = sent(llm().build_call(USER, 1, GenerationKwargs(stop_sequences="\n", logprobs=True)))
    assert list(pb.stopping.stop) == ["\n"]
    assert pb.HasField("logprobs") and pb.logprobs == 0  # the chosen token only
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=True"):
        llm().build_call(USER, 1, GenerationKwargs(top_logprobs=2))


def test_agenerate_takes_exactly_the_mapped_kwargs() -> None:
    """distilabel reads agenerate's signature for the runtime parameters it shows and accepts."""
    params = list(inspect.signature(GengateLLM.agenerate).parameters)
    assert params[:3] == ["self", "input", "num_generations"]
    assert params[3:] == list(GenerationKwargs.__dataclass_fields__)
    names = llm().runtime_parameters_names
    assert set(names["generation_kwargs"]) == set(GenerationKwargs.__dataclass_fields__)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("max_tokens", "use max_new_tokens"),
        ("stop", "use stop_sequences"),
        ("n", "num_generations"),
        ("response_format", "structured_output"),
        ("extra_body", "backend_options"),
        ("echo", "generated text only"),
        ("do_sample", "temperature=0"),
        ("typical_p", "no such request field"),
    ],
)
def test_an_unknown_kwarg_is_refused_by_name_before_any_call(name: str, hint: str) -> None:
    model = llm()  # not loaded: the refusal comes before any connection is needed
    with pytest.raises(ValueError, match=f"generation kwarg '{name}': .*{hint}") as info:
        model.generate([USER], **{name: 1})
    assert "max_new_tokens" in str(info.value)  # it lists what it takes
    with pytest.raises(ValueError, match=f"'{name}'"):
        model.offline_batch_generate([USER], **{name: 1})


def test_runtime_parameters_are_settable_from_a_pipeline() -> None:
    names = llm().runtime_parameters_names
    for name in ("address", "api_key", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        assert names[name] is True, name  # optional runtime parameters
    for name in ("tls_server_name", "metadata", "timeout", "structured_output", "batch_job_offline"):
        assert names[name] is True, name
    model = llm()
    model.set_runtime_parameters({"address": "10.0.0.1:443", "api_key": "t0k", "tls": True})
    assert model.address == "10.0.0.1:443" and model.api_key.get_secret_value() == "t0k" and model.tls


def test_the_token_never_reaches_dumps_reprs_or_metadata_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENGATE_API_KEY", "s3cret-token")
    model = llm(metadata={"x-team": "data"})
    assert model.api_key.get_secret_value() == "s3cret-token"  # read from $GENGATE_API_KEY
    assert ("authorization", "Bearer s3cret-token") in model._metadata()
    assert ("x-team", "data") in model._metadata()
    for text in (json.dumps(model.dump(), default=str), repr(model), str(model)):
        assert "s3cret-token" not in text
    with pytest.raises(ValidationError, match="put the token in api_key") as info:
        llm(metadata={"Authorization": "Bearer other-secret"})
    assert "other-secret" not in str(info.value)


def test_tls_settings_build_credentials(tmp_path: Any) -> None:
    assert llm()._credentials() is None
    assert llm(tls=True)._credentials() is not None
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        llm(tls_cert_file=str(tmp_path / "c.pem"))._credentials()
    with pytest.raises(ValueError, match=r"tls_ca_file .*missing\.pem: cannot read it"):
        llm(tls_ca_file=str(tmp_path / "missing.pem"))._credentials()
    assert llm(tls_server_name="gengate.internal")._channel_options() == [
        ("grpc.ssl_target_name_override", "gengate.internal")
    ]


def test_structured_output_forms_become_gengate_constraints() -> None:
    pb = sent(llm(structured_output={"format": "json", "schema": City}).build_call(USER))
    assert json.loads(pb.structured_output.json_schema.schema_json) == City.model_json_schema()
    assert pb.structured_output.json_schema.name == "City"

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for given in (schema, json.dumps(schema)):
        pb = sent(llm(structured_output={"format": "json", "schema": given}).build_call(USER))
        assert json.loads(pb.structured_output.json_schema.schema_json) == schema

    pb = sent(llm(structured_output={"schema": City}).build_call(USER))  # format defaults to json
    assert pb.structured_output.HasField("json_schema")

    pb = sent(llm(structured_output={"format": "regex", "schema": r"\d{3}"}).build_call(USER))
    assert pb.structured_output.regex.pattern == r"\d{3}"


def test_a_rows_structured_output_is_used_when_the_llm_has_none() -> None:
    """StructuredGeneration hands (messages, structured_output) per row."""
    row = (USER, {"format": "regex", "schema": "[a-z]+"})
    pb = sent(llm().build_call(row))
    assert pb.structured_output.regex.pattern == "[a-z]+"
    assert pb.messages.messages[0].content[0].text == "Name a city."
    with pytest.raises(ValueError, match="set on GengateLLM and in the input row too"):
        llm(structured_output={"schema": City}).build_call(row)


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        ({"format": "grammar", "schema": "x"}, "format must be 'json' or 'regex'"),
        ({"format": "regex", "schema": City}, "needs the pattern"),
        ({"format": "json"}, "needs a schema"),
        ({"format": "json", "schema": "{not json"}, "not JSON"),
        ({"format": "json", "schema": 12}, "must be a pydantic model"),
        ({"format": "json", "schema": City, "whitespace_pattern": r"[\n ]?"}, "whitespace_pattern"),
        ({"schema": City, "mode": "tools"}, "instructor options"),
        ({"schema": City, "max_retries": 2}, "instructor options"),
    ],
)
def test_unsupported_structured_outputs_are_refused_not_dropped(structured: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm().build_call((USER, structured))


MAGPIE = {"use_magpie_template": True, "magpie_pre_query_template": "qwen2"}


def test_magpie_asks_the_server_for_the_next_user_turn() -> None:
    """Magpie's per-turn calls: the conversation so far (its leading system message as the system
    prompt), one turn, only the instruction; gengate's preset name for distilabel's template."""
    model = llm(**MAGPIE)
    assert model.magpie_pre_query_template == "<|im_start|>user\n"  # distilabel resolved the alias
    conversation = [
        {"role": "system", "content": "You are a chemist."},
        {"role": "user", "content": "What is salt?"},
        {"role": "assistant", "content": "NaCl."},
    ]
    call = model.build_call(conversation, 2, GenerationKwargs(max_new_tokens=24, temperature=0.7, seed=1))
    assert call.magpie == {
        "template": "qwen2",
        "system_prompt": "You are a chemist.",
        "conversation": conversation[1:],
        "n_turns": 1,
        "only_instruction": True,
    }
    assert call.kwargs == {"max_tokens": 24, "temperature": 0.7, "seed": 1, "n": 2}  # no prompt/messages

    first = model.build_call([{"role": "system", "content": "Be terse."}])  # Magpie's first turn
    assert first.magpie is not None
    assert first.magpie["conversation"] == [] and first.magpie["system_prompt"] == "Be terse."
    empty = model.build_call([])
    assert empty.magpie is not None and empty.magpie["system_prompt"] is None

    answer = model.build_call(USER)  # the conversation ends with a user turn: a normal chat call
    assert answer.magpie is None and answer.kwargs["messages"] == USER


def test_magpie_templates_the_server_knows_or_custom_text_pass_through() -> None:
    for given, sent_as in (("llama3", "llama3"), ("phi3", "phi3"), ("<turn>user\n", "<turn>user\n")):
        model = llm(use_magpie_template=True, magpie_pre_query_template=given)
        assert model.magpie_fields([])["template"] == sent_as


def test_magpie_calls_send_gengates_magpie_request() -> None:
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
    ]
    call = llm(**MAGPIE).build_call(conversation, 2, GenerationKwargs(max_new_tokens=9, seed=4))
    for pb in (sent(call), convert.build_request(call.request("tiny"))[0]):  # online, and as a job item
        assert pb.WhichOneof("input") == "magpie"
        assert pb.magpie.preset == types_pb2.MAGPIE_PRESET_QWEN2 and pb.magpie.system_prompt == "S"
        assert [(m.role, m.content[0].text) for m in pb.magpie.conversation] == [
            (types_pb2.ROLE_USER, "Q?"),
            (types_pb2.ROLE_ASSISTANT, "A."),
        ]
        assert pb.magpie.n_turns == 1 and pb.magpie.only_instruction and not pb.magpie.end_with_user
        assert (pb.n, pb.stopping.max_tokens, pb.sampling.seed) == (2, 9, 4)
    custom = llm(use_magpie_template=True, magpie_pre_query_template="<turn>user\n").build_call([])
    assert sent(custom).magpie.template == "<turn>user\n"
    with pytest.raises(ValueError, match="Magpie writes free-text user turns"):
        llm(**MAGPIE, structured_output={"schema": City}).build_call([])


def response(*generations: types_pb2.Generation, enforcement: int = types_pb2.ENFORCEMENT_NONE) -> Any:
    pb = generation_pb2.GenerateResponse(
        model="tiny",
        generations=generations,
        usage=types_pb2.Usage(input_tokens=11, output_tokens=sum(g.output_tokens for g in generations)),
        enforcement=enforcement,
    )
    return convert.response(pb, None)


def generation(index: int, text: str, tokens: int, reason: int = types_pb2.FINISH_REASON_STOP) -> Any:
    return types_pb2.Generation(index=index, text=text, output_tokens=tokens, finish_reason=reason)


def test_a_response_becomes_distilabels_generate_output() -> None:
    out = llm()._output(response(generation(0, "a b", 2), generation(1, "c", 1)), None, with_logprobs=False)
    assert out == {
        "generations": ["a b", "c"],
        "statistics": {"input_tokens": [11, 11], "output_tokens": [2, 1]},
    }


def test_logprobs_take_distilabels_shape_chosen_token_first() -> None:
    g = generation(0, "ab", 2)
    g.logprobs.tokens.add(
        token="a",
        logprob=-0.5,
        token_id=1,
        top=[
            types_pb2.TopLogprob(token="a", logprob=-0.5, token_id=1),
            types_pb2.TopLogprob(token="b", logprob=-1.5, token_id=2),
        ],
    )
    g.logprobs.tokens.add(token="b", logprob=-0.25, top=[])
    out = llm()._output(response(g), None, with_logprobs=True)
    assert out["logprobs"] == [
        [
            [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}],
            [{"token": "b", "logprob": -0.25}],
        ]
    ]


def test_a_structured_generation_that_cannot_complete_is_that_generations_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = llm(structured_output={"schema": City})
    model.load()  # only for distilabel's logger; no call is made
    try:
        call = model.build_call(USER)
        reply = response(
            generation(0, '{"name": "Oslo", "population": 700000}', 9),
            generation(1, '{"name": "Berg', 4, types_pb2.FINISH_REASON_LENGTH),
            generation(2, '{"name": "far too long a name", "population": 1}', 9),
            enforcement=types_pb2.ENFORCEMENT_ENGINE,
        )
        with caplog.at_level(logging.WARNING):
            out = model._output(reply, call.spec, with_logprobs=False)
    finally:
        model.unload()
    assert out["generations"] == ['{"name": "Oslo", "population": 700000}', None, None]
    assert out["statistics"] == {"input_tokens": [11] * 3, "output_tokens": [9, 4, 9]}
    assert "generation 1 hit max_new_tokens" in caplog.text and "generation 2 does not parse" in caplog.text


def test_the_readme_table_has_a_row_for_every_distilabel_llm() -> None:
    """tests/unit/test_readme_distilabel.py checks the kinds and settings; this, the classes."""
    import distilabel.models.llms as llms
    from distilabel.models.llms.base import LLM

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("<!-- distilabel:start -->")[1].split("<!-- distilabel:end -->")[0]
    named = {line.strip("| ").split(" ")[0] for line in table.strip().splitlines()[2:]}
    classes = {
        name
        for name in llms.__all__
        if isinstance(getattr(llms, name), type)
        and issubclass(getattr(llms, name), LLM)
        and name not in ("LLM", "AsyncLLM")
    }
    assert classes <= named, sorted(classes - named)
