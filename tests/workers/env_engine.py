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


class ChildProcessEngine(ScriptedBackend):
    """Starts a long-lived helper process, as vLLM starts its engine core, and answers with its pid."""

    def __init__(self, name: str, options: ScriptedOptions) -> None:
        import subprocess
        import sys

        self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        super().__init__(name, options.model_copy(update={"text": str(self.helper.pid)}))
