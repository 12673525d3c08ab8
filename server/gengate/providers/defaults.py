"""Default provider models registered with no config file: one per backend kind that has a
`default_model` in the registry, whose standard API-key variable is set and whose SDK imports."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from gengate.registry import KINDS


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_provider_entries(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """Config entries (as in the YAML `models:` list) for providers whose key variable is set,
    each named after its kind. The entry names the variable (`api_key_env`), never the key."""
    entries: list[dict[str, Any]] = []
    for spec in KINDS.values():
        if spec.default_model is None:
            continue
        key_env = next((k for k in spec.key_envs if env.get(k)), None)
        if key_env is None or (spec.sdk is not None and not _importable(spec.sdk)):
            continue
        entries.append(
            {"name": spec.kind, "backend": spec.kind, "model": spec.default_model, "api_key_env": key_env}
        )
    return entries
