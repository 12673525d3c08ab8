"""The JSON Schema of the whole config file (`gengate config schema`), for editors and CI checks.

Made from the same pydantic models that validate the file: the `server:` section, each backend
kind's options (a model entry is one `oneOf` branch per kind, told apart by `backend`), the common
model keys and the `callers:` list. A check the models make across keys (e.g. `num_gpus` against
`devices`) is only in `gengate config check`.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gengate.callers.config import CallerConfig
from gengate.config import CommonModelKeys, ServerSettings
from gengate.registry import KINDS

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _options_models() -> tuple[dict[str, type[BaseModel]], dict[str, str]]:
    """Each kind's Options model; kinds whose module does not import (extra not installed) apart."""
    found: dict[str, type[BaseModel]] = {}
    missing: dict[str, str] = {}
    for kind, spec in KINDS.items():
        module, _, name = spec.target.partition(":")
        try:
            found[kind] = getattr(importlib.import_module(module), name).Options
        except ImportError as exc:
            missing[kind] = f"install gengate[{spec.extra}] to describe its options ({exc.name} is missing)"
    return found, missing


def config_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) a config file must match."""
    options, missing = _options_models()
    models: list[type[BaseModel]] = [CommonModelKeys, ServerSettings, CallerConfig, *options.values()]
    inputs: list[tuple[type[BaseModel], Literal["validation"]]] = [(m, "validation") for m in models]
    refs, top = models_json_schema(inputs, ref_template="#/$defs/{model}")
    defs: dict[str, Any] = top.get("$defs", {})

    def name_of(model: type[BaseModel]) -> str:
        ref: str = refs[(model, "validation")]["$ref"]
        return ref.rsplit("/", 1)[-1]

    def definition(model: type[BaseModel]) -> dict[str, Any]:
        found: dict[str, Any] = defs[name_of(model)]
        return found

    common = definition(CommonModelKeys)
    branches: list[dict[str, Any]] = []
    for kind in sorted(KINDS):
        props = {key: value for key, value in common["properties"].items()}
        props["backend"] = {"const": kind, "description": common["properties"]["backend"]["description"]}
        branch: dict[str, Any] = {"title": kind, "type": "object", "required": ["name", "backend"]}
        if kind in options:
            own = definition(options[kind])
            props.update(own.get("properties", {}))
            branch["required"] = ["name", "backend", *own.get("required", [])]
            branch["additionalProperties"] = False
            if own.get("description"):
                branch["description"] = own["description"]
        else:
            branch["description"] = missing[kind]
        branch["properties"] = props
        branches.append(branch)
    for model in models:  # the common keys and options are inlined in the branches above
        if model not in (ServerSettings, CallerConfig):
            defs.pop(name_of(model), None)
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "gengate server config",
        "type": "object",
        "required": ["models"],
        "additionalProperties": False,
        "properties": {
            "models": {"type": "array", "minItems": 1, "items": {"oneOf": branches}},
            "server": refs[(ServerSettings, "validation")],
            "callers": {"type": "array", "minItems": 1, "items": refs[(CallerConfig, "validation")]},
        },
        "$defs": defs,
    }
