"""Real distilabel pipelines through GengateLLM against `gengate serve` on the tiny model: text with
n generations (statistics equal to what gengate reports for the same request, asked through the
`gengate` CLI), structured output as a pydantic model and per row, an offline batch job, logprobs,
bearer tokens, and the Magpie task (the server writing the user turns)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distilabel.pipeline import Pipeline
from distilabel.steps import LoadDataFromDicts
from distilabel.steps.tasks import Magpie, StructuredGeneration, TextGeneration
from gengate_client import NotFoundError, UnauthenticatedError
from gengate_client.distilabel import GengateLLM
from pydantic import BaseModel, ConfigDict, Field
from serve_process import ServerProcess

pytestmark = pytest.mark.distilabel

INSTRUCTIONS = ["Write a haiku about the sea.", "Name three colours."]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=40_000_000)


def run(pipeline: Any) -> list[dict[str, Any]]:
    distiset = pipeline.run(use_cache=False)
    return list(distiset["default"]["train"])


def gengate_cli(*argv: str) -> str:
    """The `gengate` CLI in its own process (this one's grpc stays out of distilabel's forks)."""
    done = subprocess.run(
        [sys.executable, "-m", "gengate", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def gengate_says(address: str, tmp_path: Path, content: str, *flags: str) -> dict[str, Any]:
    """What gengate answers to the same request, asked through the `gengate` CLI."""
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": content}]))
    argv = ["generate", "--address", address, "--model", "tiny", "--messages", str(messages), "--json"]
    reply: dict[str, Any] = json.loads(gengate_cli(*argv, *flags))
    return reply


def assert_same_as_gengate(row: dict[str, Any], reply: dict[str, Any], task: str) -> None:
    """The row's generations and statistics are gengate's texts, output tokens and input tokens."""
    generations = reply["generations"]
    assert row["generation"] == [g.get("text", "") for g in generations]
    statistics = [meta[f"statistics_{task}"] for meta in row["distilabel_metadata"]]
    assert statistics == [
        {"input_tokens": reply["usage"]["inputTokens"], "output_tokens": g.get("outputTokens", 0)}
        for g in generations
    ]
    assert sum(s["output_tokens"] for s in statistics) == reply["usage"]["outputTokens"]


def text_generation_pipeline(name: str, llm: GengateLLM) -> Any:
    with Pipeline(name=name) as pipeline:
        rows = LoadDataFromDicts(data=[{"instruction": i} for i in INSTRUCTIONS])
        rows >> TextGeneration(name="gen", llm=llm, num_generations=2, group_generations=True)
    return pipeline


def test_text_generation_with_two_generations_per_row(gengate_address: str, tmp_path: Path) -> None:
    llm = GengateLLM(
        model="tiny", address=gengate_address, generation_kwargs={"max_new_tokens": 12, "seed": 5}
    )
    rows = run(text_generation_pipeline("gengate-text", llm))
    assert [row["instruction"] for row in rows] == INSTRUCTIONS
    for row in rows:
        assert len(row["generation"]) == 2 and all(isinstance(g, str) for g in row["generation"])
        assert row["model_name"] == "tiny"
        reply = gengate_says(gengate_address, tmp_path, row["instruction"], "--n", "2", "--seed", "5",
                             "--max-tokens", "12")  # fmt: skip
        assert_same_as_gengate(row, reply, "gen")


def test_offline_batch_generation_runs_as_a_gengate_batch_job(gengate_address: str, tmp_path: Path) -> None:
    llm = GengateLLM(
        model="tiny",
        address=gengate_address,
        generation_kwargs={"max_new_tokens": 12, "seed": 5},
        use_offline_batch_generation=True,
        offline_batch_generation_block_until_done=1,  # poll the job every second
    )
    rows = run(text_generation_pipeline("gengate-batch", llm))
    assert [row["instruction"] for row in rows] == INSTRUCTIONS
    jobs = [
        json.loads(line)
        for line in gengate_cli("batch", "list", "--address", gengate_address, "--json").split("\n")
        if line
    ]
    (job,) = [job for job in jobs if job["name"] == "distilabel gengate-batch"]
    assert (job["state"], job["total"], job["done"], job["offline"]) == ("succeeded", 2, 2, False)
    assert job["usage"]["output_tokens"] == sum(
        meta["statistics_gen"]["output_tokens"] for row in rows for meta in row["distilabel_metadata"]
    )
    for row in rows:  # the job ran the very requests an online call sends: same seed, same answers
        reply = gengate_says(gengate_address, tmp_path, row["instruction"], "--n", "2", "--seed", "5",
                             "--max-tokens", "12")  # fmt: skip
        assert_same_as_gengate(row, reply, "gen")


def test_structured_output_rows_parse_as_the_pydantic_model(gengate_address: str) -> None:
    llm = GengateLLM(
        model="tiny",
        address=gengate_address,
        structured_output={"format": "json", "schema": City},
        generation_kwargs={"max_new_tokens": 200, "seed": 11},
    )
    with Pipeline(name="gengate-structured") as pipeline:
        rows = LoadDataFromDicts(data=[{"instruction": f"A city as JSON, number {i}:"} for i in range(3)])
        rows >> TextGeneration(name="city", llm=llm)
    out = run(pipeline)
    assert len(out) == 3
    for row in out:
        city = City.model_validate_json(row["generation"])
        assert len(city.name) <= 12


def test_structured_generation_takes_each_rows_own_structured_output(gengate_address: str) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    data = [
        {"instruction": "A code:", "structured_output": {"format": "regex", "schema": "[0-9]{3}-[A-Z]{2}"}},
        {"instruction": "Is it?", "structured_output": {"format": "json", "schema": schema}},
    ]
    llm = GengateLLM(
        model="tiny", address=gengate_address, generation_kwargs={"max_new_tokens": 64, "seed": 2}
    )
    with Pipeline(name="gengate-per-row") as pipeline:
        LoadDataFromDicts(data=data) >> StructuredGeneration(name="rows", llm=llm)
    code, answer = run(pipeline)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", code["generation"])
    assert isinstance(json.loads(answer["generation"])["ok"], bool)


def test_logprobs_and_errors_through_the_llm_itself(gengate_address: str) -> None:
    llm = GengateLLM(model="tiny", address=gengate_address)
    llm.load()
    try:
        (out,) = llm.generate(
            [[{"role": "user", "content": "Hi"}]], num_generations=2, max_new_tokens=5, seed=3,
            logprobs=True, top_logprobs=2,
        )  # fmt: skip
    finally:
        llm.unload()
    assert len(out["generations"]) == 2 and len(out["logprobs"]) == 2
    for positions, tokens in zip(out["logprobs"], out["statistics"]["output_tokens"], strict=True):
        assert len(positions) == tokens  # one entry per generated token
        for candidates in positions:
            assert 1 <= len(candidates) <= 3  # the chosen token, then up to 2 alternatives
            assert all(set(c) == {"token", "logprob"} and c["logprob"] <= 0 for c in candidates)

    missing = GengateLLM(model="no-such-model", address=gengate_address)
    missing.load()
    try:
        with pytest.raises(NotFoundError, match="no-such-model"):
            missing.generate([[{"role": "user", "content": "Hi"}]])
    finally:
        missing.unload()


TOKEN = "gg-distilabel-token-51c2"


@pytest.fixture(scope="module")
def guarded_address() -> Iterator[str]:
    """A server that wants a bearer token (auth_tokens_env), on the scripted echo model."""
    config = {"models": [{"name": "echo", "backend": "scripted"}], "server": {"auth_tokens_env": "GG_TOKENS"}}
    server = ServerProcess(config, env={"GG_TOKENS": TOKEN})
    try:
        yield server.address
    finally:
        server.stop()


def test_the_api_key_is_the_bearer_token_and_never_shows(guarded_address: str) -> None:
    ask = [[{"role": "user", "content": "Hi"}]]
    llm = GengateLLM(model="echo", address=guarded_address, api_key=TOKEN)
    llm.load()
    try:
        (out,) = llm.generate(ask, max_new_tokens=8)
    finally:
        llm.unload()
    assert out["generations"] and out["generations"][0]
    assert TOKEN not in json.dumps(llm.dump(), default=str) and TOKEN not in repr(llm)

    wrong = GengateLLM(model="echo", address=guarded_address, api_key="not-the-token")
    wrong.load()
    try:
        with pytest.raises(UnauthenticatedError) as info:
            wrong.generate(ask)
    finally:
        wrong.unload()
    assert "not-the-token" not in str(info.value)


def test_magpie_rows_have_an_instruction_and_a_response(gengate_address: str) -> None:
    llm = GengateLLM(
        model="tiny",
        address=gengate_address,
        magpie_pre_query_template="qwen2",  # the tiny model's template is ChatML
        generation_kwargs={"max_new_tokens": 16, "seed": 9},
    )
    with Pipeline(name="gengate-magpie") as pipeline:
        rows = LoadDataFromDicts(data=[{"system_prompt": "You are a poet."}, {"system_prompt": "You cook."}])
        rows >> Magpie(name="magpie", llm=llm, n_turns=1)
    out = run(pipeline)
    assert len(out) == 2
    for row in out:
        assert isinstance(row["instruction"], str) and row["instruction"]
        assert isinstance(row["response"], str)
