"""The `callers:` section: good configs load as written, and every bad one stops the start with
a ConfigError naming the caller (hostile and careless configs alike)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from gengate.callers.config import normalize_subject
from gengate.callers.identity import CallerDirectory
from gengate.config import parse_config
from gengate.errors import ConfigError

MODELS = [{"name": "tiny", "backend": "scripted"}, {"name": "gpt", "backend": "scripted"}]
TOKEN_A = "team-a-token-0123456789"
SHA_A = hashlib.sha256(TOKEN_A.encode()).hexdigest()


def config(callers: Any, server: dict[str, Any] | None = None) -> Any:
    return parse_config({"models": MODELS, "callers": callers, "server": server or {}}, source="cfg.yaml")


def test_a_full_caller_entry_loads_as_written() -> None:
    loaded = config(
        [
            {
                "name": "team-a",
                "token_env": "TEAM_A_TOKEN",
                "models": ["tiny", "gpt"],
                "requests_per_minute": 600,
                "tokens_per_minute": 200000,
                "max_concurrency": 32,
                "priority": 10,
            },
            {"name": "team-b", "token_sha256": SHA_A.upper()},
        ]
    )
    a, b = loaded.callers
    assert (a.name, a.token_env, a.models, a.priority) == ("team-a", "TEAM_A_TOKEN", ("tiny", "gpt"), 10)
    assert (a.requests_per_minute, a.tokens_per_minute, a.max_concurrency) == (600, 200000, 32)
    assert a.limited and not b.limited
    assert b.token_sha256 == (SHA_A,) and b.models is None and b.priority == 0  # digests compare lower-case


def test_no_callers_section_means_no_callers() -> None:
    assert parse_config({"models": MODELS}).callers == ()


@pytest.mark.parametrize(
    ("callers", "server", "message"),
    [
        ([{"name": "team-a"}], {}, r"callers\[0\] \(team-a\): .*no token source"),
        ([{"name": "team-a", "token_env": "A", "token_sha256": SHA_A}], {}, r"\(team-a\).*not both"),
        ([{"name": "team-a", "token_sha256": "abc"}], {}, r"\(team-a\).*64 hex digits"),
        ([{"name": "team-a", "token_sha256": []}], {}, r"\(team-a\).*no digest"),
        ([{"name": "team-a", "token_env": " "}], {}, r"\(team-a\).*environment variable"),
        (
            [{"name": "team-a", "token_env": "A", "requests_per_minute": 0}],
            {},
            r"\(team-a\).*requests_per_minute",
        ),
        (
            [{"name": "team-a", "token_env": "A", "tokens_per_minute": -5}],
            {},
            r"\(team-a\).*tokens_per_minute",
        ),
        ([{"name": "team-a", "token_env": "A", "max_concurrency": 0}], {}, r"\(team-a\).*max_concurrency"),
        ([{"name": "team-a", "token_env": "A", "max_concurrency": True}], {}, r"\(team-a\).*max_concurrency"),
        ([{"name": "team-a", "token_env": "A", "requests_per_minute": "600"}], {}, r"requests_per_minute"),
        ([{"name": "team-a", "token_env": "A", "priority": 10**9}], {}, r"\(team-a\).*priority"),
        ([{"name": "team-a", "token_env": "A", "models": ["ghost"]}], {}, r"\(team-a\).*\['ghost'\] are not"),
        ([{"name": "team-a", "token_env": "A", "models": []}], {}, r"\(team-a\).*lists no model"),
        ([{"name": "team-a", "token_env": "A", "models": ["tiny", "tiny"]}], {}, r"more than once"),
        ([{"name": "team-a", "token_env": "A", "rpm": 5}], {}, r"\(team-a\): rpm: unknown key"),
        ([{"name": "team a", "token_env": "A"}], {}, r"name: must be 1-64 letters"),
        ([{"name": "x\nINFO forged log line", "token_env": "A"}], {}, r"name: must be 1-64"),
        ([{"name": "", "token_env": "A"}], {}, r"callers\[0\]: name"),
        ([{"token_env": "A"}], {}, r"callers\[0\]: name"),
        (["team-a"], {}, r"callers\[0\]: must be a mapping"),
        ([], {}, r"'callers' must be a non-empty list"),
        ({"team-a": {}}, {}, r"'callers' must be a non-empty list"),
        ([{"name": "anonymous", "token_env": "A"}], {}, r"'anonymous' is taken"),
        ([{"name": "default", "token_env": "A"}], {"auth_tokens_env": "T"}, r"'default' is taken"),
        ([{"name": "team-b", "subject": "CN=team-b"}], {}, r"\(team-b\): subject needs mutual TLS"),
        ([{"name": "team-b", "subject": "team-b"}], {}, r"\(team-b\).*not a distinguished name"),
        (
            [{"name": "a", "token_env": "A"}, {"name": "a", "token_env": "B"}],
            {},
            r"more than one caller is named 'a'",
        ),
        (
            [{"name": "a", "token_sha256": SHA_A}, {"name": "b", "token_sha256": [SHA_A.upper()]}],
            {},
            r"callers 'a' and 'b' have the same token",
        ),
        (
            [{"name": "a", "token_env": "SAME"}, {"name": "b", "token_env": "SAME"}],
            {},
            r"callers 'a' and 'b' have the same token variable",
        ),
    ],
)
def test_bad_caller_configs_fail_naming_the_caller(
    callers: Any, server: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(callers, server)


def test_two_callers_with_one_subject_are_refused(tmp_path: Any) -> None:
    tls = {"tls_cert_file": "c.pem", "tls_key_file": "k.pem", "tls_client_ca_file": "ca.pem"}
    with pytest.raises(ConfigError, match="callers 'a' and 'b' have the same subject"):
        config([{"name": "a", "subject": "CN=x, O=Acme"}, {"name": "b", "subject": "cn=x,O=Acme"}], tls)


def test_subjects_compare_in_one_spelling() -> None:
    assert normalize_subject("cn=team-b, O=Acme\\, Inc") == "CN=team-b,O=Acme\\, Inc"
    assert normalize_subject(" CN = team-b ") == "CN=team-b"
    for bad in ("", "team-b", "CN=", "=x", "CN=a,,O=b"):
        with pytest.raises(ValueError):
            normalize_subject(bad)


# -- what needs the environment: checked when the server starts ----------------------------


def directory(callers: Any, env: dict[str, str], legacy: str | None = None) -> CallerDirectory | None:
    return CallerDirectory.from_config(config(callers).callers, legacy_tokens_env=legacy, env=env)


def test_a_token_variable_that_is_not_set_fails_naming_caller_and_variable() -> None:
    with pytest.raises(
        ConfigError, match=r"callers \(team-a\): token_env names TEAM_A_TOKEN, which is not set"
    ):
        directory([{"name": "team-a", "token_env": "TEAM_A_TOKEN"}], {})
    with pytest.raises(ConfigError, match=r"\(team-a\).*holds no token"):
        directory([{"name": "team-a", "token_env": "TEAM_A_TOKEN"}], {"TEAM_A_TOKEN": " , "})


def test_a_short_token_is_refused_it_could_not_be_kept_out_of_logs() -> None:
    with pytest.raises(ConfigError, match=r"\(team-a\).*shorter than 8 characters"):
        directory([{"name": "team-a", "token_env": "T"}], {"T": "abc"})


def test_two_callers_with_one_token_are_refused_by_hash() -> None:
    callers = [{"name": "a", "token_env": "A"}, {"name": "b", "token_sha256": SHA_A}]
    with pytest.raises(ConfigError, match="callers 'a' and 'b' have the same token"):
        directory(callers, {"A": TOKEN_A})
    # ...also when one of them is server.auth_tokens_env's "default" caller.
    with pytest.raises(ConfigError, match="callers 'default' and 'b' have the same token"):
        directory([{"name": "b", "token_sha256": SHA_A}], {"LEGACY": TOKEN_A}, legacy="LEGACY")


def test_tokens_identify_their_caller_and_nothing_else_does() -> None:
    found = directory(
        [{"name": "a", "token_env": "A"}, {"name": "b", "token_sha256": SHA_A}],
        {"A": "first-token-aaaa, second-token-aaaa"},
    )
    assert found is not None
    assert found.identify([("authorization", "Bearer first-token-aaaa")]).name == "a"
    assert found.identify([("authorization", "bearer second-token-aaaa")]).name == "a"  # rotation
    assert found.identify([("authorization", f"Bearer {TOKEN_A}")]).name == "b"
    from gengate.errors import Unauthenticated

    for metadata, reason in (
        ([], "MISSING_CREDENTIALS"),
        ([("authorization", "Bearer nope-nope-nope")], "INVALID_CREDENTIALS"),
        ([("authorization", f"Basic {TOKEN_A}")], "INVALID_CREDENTIALS"),
        ([("authorization", "Bearer ")], "INVALID_CREDENTIALS"),
    ):
        with pytest.raises(Unauthenticated) as caught:
            found.identify(metadata)
        assert caught.value.reason == reason


def test_no_callers_and_no_token_variable_is_authentication_off() -> None:
    assert CallerDirectory.from_config((), env={}) is None


def test_the_legacy_token_variable_is_one_caller_without_limits() -> None:
    found = CallerDirectory.from_config((), legacy_tokens_env="T", env={"T": "legacy-token-1"})
    assert found is not None
    caller = found.identify([("authorization", "Bearer legacy-token-1")])
    assert caller.name == "default" and not caller.limited and caller.models is None
