"""`gengate generate` / `gengate models` against the fake server: arguments reach the server as given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_gengate import RunningFake
from gengate.cli import main
from gengate_proto.v1 import types_pb2


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_generate_prints_text(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "generate", "--address", fake.address, "--model", "tiny", "--prompt", "hi")
    assert (status, out, err) == (0, "echo 0: hi\n", "")
    sent = fake.servicer.requests[-1]
    assert sent.prompt == "hi" and not sent.HasField("n") and not sent.stopping.HasField("max_tokens")


def test_generate_passes_every_option(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "generate",
        "--address", fake.address,
        "--model", "tiny",
        "--prompt", "p",
        "--max-tokens", "9",
        "--n", "2",
        "--seed", "4",
        "--temperature", "0.5",
        "--top-p", "0.9",
        "--top-k", "3",
        "--stop", "END",
        "--logprobs", "2",
        "--request-id", "r-7",
        "--option", "min_tokens=5",
        "--option", "ignore_eos=true",
        "--option", "lora=sql",
        "--option", "scale=0.5",
        "--metadata", "Authorization=Bearer s3cret",
    )  # fmt: skip
    assert status == 0 and out == "echo 0: p\necho 1: p\n"
    sent = fake.servicer.requests[-1]
    assert sent.stopping.max_tokens == 9 and list(sent.stopping.stop) == ["END"] and sent.n == 2
    assert sent.sampling.seed == 4 and sent.sampling.temperature == 0.5 and sent.sampling.top_k == 3
    assert sent.logprobs == 2 and sent.request_id == "r-7"
    options = {k: v.WhichOneof("value") for k, v in sent.backend_options.items()}
    assert options == {
        "min_tokens": "int_value",
        "ignore_eos": "bool_value",
        "lora": "string_value",
        "scale": "double_value",
    }
    assert (
        sent.backend_options["min_tokens"].int_value == 5
        and sent.backend_options["lora"].string_value == "sql"
    )
    assert fake.servicer.metadata[-1]["authorization"] == "Bearer s3cret"


def test_json_output_is_protobuf_json(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "generate",
        "--address",
        fake.address,
        "--model",
        "tiny",
        "--prompt",
        "x",
        "--seed",
        "3",
        "--json",
    )
    data = json.loads(out)
    assert status == 0 and data["generations"][0]["text"] == "echo 0: x"
    assert data["generations"][0]["finishReason"] == "FINISH_REASON_STOP"
    assert data["effectiveSampling"]["seed"] == "3" and data["usage"]["inputTokens"] == 5


@pytest.mark.parametrize(
    ("flags", "field", "violation"),
    [
        (["--max-tokens", "0"], "stopping.max_tokens", "must be > 0"),
        (["--n", "1000"], "n", "exceeds max_n 8"),
    ],
)
def test_out_of_range_values_reach_the_server(
    fake: RunningFake, capsys: pytest.CaptureFixture[str], flags: list[str], field: str, violation: str
) -> None:
    status, out, err = run(
        capsys, "generate", "--address", fake.address, "--model", "tiny", "--prompt", "x", *flags
    )
    assert status == 1 and out == ""
    assert err.startswith("INVALID_ARGUMENT: ")
    assert f"  {field}: {violation}" in err
    assert len(fake.servicer.requests) == 1  # the server, not the CLI, refused it


def test_unknown_model_is_not_found(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "generate", "--address", fake.address, "--model", "ghost", "--prompt", "x")
    assert status == 1 and err.splitlines()[0] == "NOT_FOUND: model 'ghost' is not served"
    assert "reason: MODEL_NOT_FOUND" in err


def test_unreachable_server_is_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(
        capsys, "generate", "--address", "127.0.0.1:1", "--model", "m", "--prompt", "x", "--timeout", "5"
    )
    assert status == 1 and err.startswith("UNAVAILABLE: ")


def test_structured_output_flags(
    fake: RunningFake, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ["generate", "--address", fake.address, "--model", "tiny", "--prompt", "x"]
    assert run(capsys, *base, "--choice", "red", "--choice", "blue", "--n", "2")[1] == "red\nblue\n"
    assert list(fake.servicer.requests[-1].structured_output.choice.choices) == ["red", "blue"]

    assert run(capsys, *base, "--regex", r"\d{4}-\d{2}-\d{2}")[1] == "2024-01-31\n"
    assert fake.servicer.requests[-1].structured_output.regex.pattern == r"\d{4}-\d{2}-\d{2}"

    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}}))
    status, out, _ = run(capsys, *base, "--json-schema", str(schema))
    assert status == 0 and json.loads(out)["name"] == "Paris"
    sent_schema = json.loads(fake.servicer.requests[-1].structured_output.json_schema.schema_json)
    assert sent_schema["properties"]["name"]["type"] == "string"

    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    assert run(capsys, *base, "--grammar", str(grammar), "--grammar-syntax", "gbnf")[1] == "yes\n"
    sent_grammar = fake.servicer.requests[-1].structured_output.grammar
    assert (
        sent_grammar.syntax == types_pb2.GRAMMAR_SYNTAX_GBNF
        and sent_grammar.definition == 'root ::= "yes" | "no"'
    )

    assert run(capsys, *base, "--json-object")[1] == '{"ok": true}\n'


def test_messages_file(fake: RunningFake, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    path.write_text(
        json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    )
    status, out, _ = run(
        capsys, "generate", "--address", fake.address, "--model", "tiny", "--messages", str(path)
    )
    assert status == 0 and out == "echo 0: Be brief. Hi\n"
    path.write_text("{not json")
    status, _, err = run(
        capsys, "generate", "--address", fake.address, "--model", "tiny", "--messages", str(path)
    )
    assert status == 2 and "not valid JSON" in err


def test_stream_text_and_json_frames(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--address", fake.address, "--model", "tiny", "--prompt", "a b c", "--stream"]
    status, out, _ = run(capsys, *base)
    assert status == 0 and out == "echo 0: a b c\n"
    status, out, _ = run(capsys, *base, "--json")
    frames = [json.loads(line) for line in out.splitlines()]
    assert list(frames[0]) == ["start"] and frames[0]["start"]["model"] == "tiny"
    assert "".join(f["delta"]["text"] for f in frames if "delta" in f) == "echo 0: a b c"
    assert frames[-1]["end"]["finishReason"] == "FINISH_REASON_STOP"
    status, out, _ = run(capsys, *base, "--n", "2")
    assert out.splitlines() == ["[0] echo 0: a b c", "[1] echo 1: a b c"]


def test_stream_error_prints_status_and_fails(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.servicer.stream_error_after = 1
    status, out, err = run(
        capsys, "generate", "--address", fake.address, "--model", "tiny", "--prompt", "a b c", "--stream"
    )
    assert status == 1 and out == "echo " and err.startswith("UNAVAILABLE: engine worker died")


def test_models_table_and_json(fake: RunningFake, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "models", "--address", fake.address)
    lines = out.splitlines()
    assert status == 0 and lines[0].split() == [
        "NAME",
        "BACKEND",
        "CONSTRAINTS",
        "GRAMMARS",
        "MAX_N",
        "CONTEXT",
        "FEATURES",
        "OPTIONS",
    ]
    assert lines[1].split() == [
        "tiny",
        "llamacpp",
        "json_schema=engine,regex=engine,choice=engine,grammar=engine",
        "lark,gbnf",
        "8",
        "2048",
        "chat,logprobs,seed",
        "ignore_eos,min_tokens",
    ]
    assert lines[2].split() == ["remote", "openai", "-", "-", "1", "?", "-", "-"]
    status, out, _ = run(capsys, "models", "--address", fake.address, "--json")
    assert [m["name"] for m in json.loads(out)["models"]] == ["tiny", "remote"]


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--address", "x:1", "--model", "m"])  # neither --prompt nor --messages
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(
            ["generate", "--address", "x:1", "--model", "m", "--prompt", "p", "--regex", "a", "--choice", "b"]
        )
    capsys.readouterr()
    status, _, err = run(capsys, "serve", "--config", "/nonexistent/gengate.yaml")
    assert status == 2 and "cannot read config" in err
    status, _, err = run(
        capsys, "generate", "--address", "x:1", "--model", "m", "--prompt", "p", "--option", "n"
    )
    assert status == 2 and "--option 'n': expected KEY=VALUE" in err
