"""A scripted engine that answers with the GPU environment its worker process was started with."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from gengate import errors
from gengate.domain import GenerationRequest, GenerationResult, StreamEvent
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


class RaisingEngine(ScriptedBackend):
    """Raises, inside its worker process, the error the prompt names; the message carries the pid."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        raise _error_for(request)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        raise _error_for(request)
        yield  # an async generator, so the error comes on the first frame as an engine's would


def _error_for(request: GenerationRequest) -> Exception:
    where = f"in process {os.getpid()}"
    if request.prompt == "invalid":
        return errors.InvalidArgument.field("request.prompt", f"refused by the engine {where}")
    if request.prompt == "busy":
        return errors.Unavailable(f"engine busy {where}", reason="ENGINE_BUSY", retry_after_s=3)
    return ValueError(f"a bug {where}")


class StartGateEngine(ScriptedBackend):
    """Fails to start while the file named by $GENGATE_TEST_START_GATE exists: a restart that
    fails until the test lets it succeed."""

    async def start(self) -> None:
        gate = os.environ.get("GENGATE_TEST_START_GATE", "")
        if gate and os.path.exists(gate):
            raise RuntimeError(f"start gate {gate} is closed")
        await super().start()
