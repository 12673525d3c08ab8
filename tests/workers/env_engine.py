"""A scripted engine that answers with the GPU environment its worker process was started with."""

from __future__ import annotations

import os

from gengate.engines.scripted import ScriptedBackend, ScriptedOptions


class EnvEngine(ScriptedBackend):
    def __init__(self, name: str, options: ScriptedOptions) -> None:
        env = " ".join(
            f"{key}={os.environ.get(key, '<unset>')}" for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
        )
        super().__init__(name, options.model_copy(update={"text": env}))
