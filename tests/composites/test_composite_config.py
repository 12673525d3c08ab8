"""Composite configuration mistakes are caught at start-up, naming the composite and the member."""

from __future__ import annotations

from asyncio import Semaphore
from typing import Any

import pytest
from composite_members import KIND, CoreFactory
from gengate.composites.mixture import MixtureOfAgentsBackend, MixtureOptions
from gengate.config import ModelConfig, parse_config
from gengate.domain import ChatMessage, ConstraintKind, Enforcement, GenerationRequest, Role, TextPart
from gengate.errors import ConfigError
from gengate.router import Route, Router


def member(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": KIND, **options}


def router(*models: dict[str, Any]) -> Router:
    return Router.from_config(parse_config({"models": list(models)}))


def test_unknown_member_names_the_composite_and_the_member() -> None:
    fb = {"name": "fb", "backend": "fallback", "models": ["a", "nope"]}
    with pytest.raises(ConfigError, match=r"models\[1\] \(fb\): member\(s\) \['nope'\] are not configured"):
        parse_config({"models": [member("a"), fb]})
    # A router built without the config loader checks too.
    options = MixtureOptions(proposers=["a"], aggregator="judge")
    backend = MixtureOfAgentsBackend("moa", options)
    routes = [Route(ModelConfig("moa", "mixture_of_agents", options), backend, Semaphore())]
    with pytest.raises(ConfigError, match=r"'moa' \(mixture_of_agents\): member 'a' is not a configured"):
        Router(routes)


def test_cycles_and_self_references_are_refused() -> None:
    with pytest.raises(ConfigError, match="cycle: one -> two -> one"):
        router(
            member("a"),
            {"name": "one", "backend": "fallback", "models": ["a", "two"]},
            {"name": "two", "backend": "mixture_of_agents", "proposers": ["a"], "aggregator": "one"},
        )
    with pytest.raises(ConfigError, match=r"'fb' .* names itself"):
        router(member("a"), {"name": "fb", "backend": "fallback", "models": ["a", "fb"]})


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"backend": "fallback", "models": ["a"]}, "models: List should have at least 2 items"),
        ({"backend": "fallback", "models": ["a", "a"]}, "must be distinct"),
        ({"backend": "fallback", "models": ["a", "b"], "on": ["SOMETIMES"]}, "unknown status code"),
        ({"backend": "fallback", "models": ["a", "b"], "max_attempts": 0}, "max_attempts"),
        ({"backend": "mixture_of_agents", "proposers": [], "aggregator": "a"}, "proposers"),
        ({"backend": "mixture_of_agents", "proposers": ["a"]}, "aggregator: Field required"),
        (
            {
                "backend": "mixture_of_agents",
                "proposers": ["a"],
                "aggregator": "b",
                "aggregator_prompt": "Sum up.",
            },
            r"must contain \{responses\}",
        ),
        ({"backend": "mixture_of_agents", "proposers": ["a"], "aggregator": "b", "rounds": 0}, "rounds"),
    ],
)
def test_bad_options_are_config_errors(entry: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=f"models\\[2\\] \\(c\\): .*{problem}"):
        parse_config({"models": [member("a"), member("b"), {"name": "c", **entry}]})


async def test_a_raw_prompt_member_cannot_join_a_mixture(make_core: CoreFactory) -> None:
    models = [
        member("plain", chat=False),
        member("agg"),
        {"name": "moa", "backend": "mixture_of_agents", "proposers": ["plain"], "aggregator": "agg"},
    ]
    with pytest.raises(ConfigError, match=r"'moa' .*\['plain'\] take only raw prompts"):
        await make_core(models)


async def test_composites_of_composites_start_after_their_members(make_core: CoreFactory) -> None:
    core = await make_core(
        [
            member("down", fail="UNAVAILABLE", constraints={"regex": "engine", "choice": "engine"}),
            member("up", text="fine", constraints={"regex": "native"}),
            member("p", text="idea"),
            {"name": "fb", "backend": "fallback", "models": ["down", "up"]},
            {"name": "moa", "backend": "mixture_of_agents", "proposers": ["p", "fb"], "aggregator": "fb"},
        ]
    )
    caps = {m.name: m.capabilities for m in core.list_models()}
    assert caps["moa"].constraints == {ConstraintKind.REGEX: Enforcement.NATIVE}
    request = GenerationRequest(model="moa", messages=(ChatMessage(Role.USER, (TextPart("q"),)),))
    assert (await core.generate(request)).generations[0].text == "fine"
