"""llama.cpp load settings the engine resolves before and after loading a GGUF.

- GPU offload that agrees with the worker's placement: placement sets CUDA_VISIBLE_DEVICES before
  the worker starts, so llama.cpp sees exactly the placed GPUs, numbered from 0 (main_gpu 0 is
  the first placed GPU). `n_gpu_layers` left unset offloads every layer when a GPU was placed and
  the llama-cpp-python build can offload, and none otherwise; an explicit offload that cannot
  happen is a start-up error, never a silent run on CPU.
- Where llama.cpp put each layer, read from its load log (no API says so), so the engine can
  report it and refuse a GPU offload that ended on the CPU.
- Chat formats named as llama-cpp-python names them (`chat_format: chatml`), rendered by
  gengate's own prompt path with llama-cpp-python's formatter for that name.

Importing this module does not import llama_cpp; the functions that need it import it.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gengate.errors import ConfigError

ALL_LAYERS = -1  # llama-cpp-python's n_gpu_layers for "every layer"
CPU_DEVICE = "CPU"
# Chat formats llama-cpp-python reads from a GGUF's metadata (`chat_template.default`, ...).
GGUF_TEMPLATE_PREFIX = "chat_template."


def gpu_layers(
    requested: int | None,
    *,
    visible_devices: str | None,
    supports_offload: bool,
    model: str,
    platform: str = sys.platform,
) -> int:
    """The n_gpu_layers to load with; ConfigError when an explicit offload cannot happen.

    `visible_devices` is the worker's CUDA_VISIBLE_DEVICES: None when gengate placed nothing
    (isolation: inline), "" for a worker given no GPU, "0,1" for the GPUs placement gave it.
    On macOS (Metal) CUDA_VISIBLE_DEVICES means nothing, so only the build's support counts.
    """
    placed = bool(visible_devices and visible_devices.strip())
    if requested is None:
        return ALL_LAYERS if placed and supports_offload else 0
    if requested == 0:
        return 0
    if not supports_offload:
        raise ConfigError(
            f"model {model!r}: n_gpu_layers is {requested}, but this llama-cpp-python build has no GPU "
            "offload (llama_cpp.llama_supports_gpu_offload() is False); install a GPU build "
            "(e.g. CMAKE_ARGS='-DGGML_CUDA=on' pip install llama-cpp-python) or set n_gpu_layers: 0"
        )
    if visible_devices is not None and not placed and platform != "darwin":
        raise ConfigError(
            f"model {model!r}: n_gpu_layers is {requested}, but this worker was given no GPU "
            "(CUDA_VISIBLE_DEVICES is empty); set 'devices: auto' or a list of GPUs on the model"
        )
    return requested


@dataclass(frozen=True)
class LayerPlacement:
    """Where llama.cpp put a model's layers: device name (CPU, CUDA0, ...) -> layer count."""

    devices: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.devices.values())

    @property
    def offloaded(self) -> int:
        """Layers on a device other than the CPU."""
        return sum(n for device, n in self.devices.items() if device != CPU_DEVICE)

    def describe(self) -> str:
        """`3/3 layers on CUDA0`, or `2/3 layers on CUDA0, 1 on CPU`."""
        gpus = ", ".join(f"{d}: {n}" for d, n in sorted(self.devices.items()) if d != CPU_DEVICE)
        if not gpus:
            return f"all {self.total} layers on the CPU"
        on_cpu = self.devices.get(CPU_DEVICE, 0)
        return f"{self.offloaded}/{self.total} layers offloaded ({gpus})" + (
            f", {on_cpu} on the CPU" if on_cpu else ""
        )


_LAYER_LINE = re.compile(r"layer\s+(\d+) assigned to device ([^\s,]+)")
_OFFLOADED_LINE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def layer_placement(log_lines: Sequence[str]) -> LayerPlacement | None:
    """The layer placement a model's load log reports, or None when it reports none (another
    llama.cpp version may word it differently: then the engine cannot tell, and says so)."""
    by_layer: dict[int, str] = {}
    offloaded: tuple[int, int] | None = None
    for line in log_lines:
        for layer, device in _LAYER_LINE.findall(line):
            by_layer[int(layer)] = device
        match = _OFFLOADED_LINE.search(line)
        if match:
            offloaded = int(match[1]), int(match[2])
    if by_layer:
        return LayerPlacement(dict(Counter(by_layer.values())))
    if offloaded is not None:
        on_gpu, total = offloaded
        return LayerPlacement({d: n for d, n in (("GPU", on_gpu), (CPU_DEVICE, total - on_gpu)) if n})
    return None


def check_offload(
    n_gpu_layers: int, placement: LayerPlacement | None, *, model: str, visible: str | None
) -> None:
    """ConfigError when layers were to go to a GPU and llama.cpp put them all on the CPU (a GPU
    build that sees no usable GPU falls back to the CPU without an error of its own)."""
    if n_gpu_layers == 0 or placement is None or placement.offloaded > 0:
        return
    shown = "unset" if visible is None else repr(visible)
    raise ConfigError(
        f"model {model!r}: n_gpu_layers is {n_gpu_layers}, but llama.cpp put all {placement.total} layers "
        f"on the CPU (CUDA_VISIBLE_DEVICES {shown}): it sees no GPU it can use; check the worker's devices "
        "and the llama-cpp-python build, or set n_gpu_layers: 0"
    )


class _LoadLog:
    """llama.cpp's log, collected per thread while a model loads; every line still goes on to
    llama-cpp-python's own handler (which prints it when `verbose`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._installed = False
        self._lock = threading.Lock()
        self._callback: Any = None  # the ctypes callback; referenced so it is never collected

    def _install(self) -> None:
        import llama_cpp
        from llama_cpp import _logger

        forward = _logger.llama_log_callback

        def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            lines: list[str] | None = getattr(self._local, "lines", None)
            if lines is not None and text:
                lines.append(text.decode("utf-8", errors="replace"))
            forward(level, text, user_data)

        self._callback = llama_cpp.llama_log_callback(on_log)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    @contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Collects the lines llama.cpp logs on this thread inside the block."""
        with self._lock:
            if not self._installed:
                self._install()
                self._installed = True
        lines: list[str] = []
        self._local.lines = lines
        try:
            yield lines
        finally:
            self._local.lines = None


LOAD_LOG = _LoadLog()


# --- chat formats ---------------------------------------------------------------------------------

ChatFormatter = Callable[..., Any]  # llama-cpp-python's: (messages=[...]) -> ChatFormatterResponse


def _registered_handlers() -> Mapping[str, Any]:
    from llama_cpp import llama_chat_format

    registry: Any = llama_chat_format.LlamaChatCompletionHandlerRegistry
    handlers: Mapping[str, Any] = registry()._chat_handlers
    return handlers


def _formatter_of(handler: Any) -> ChatFormatter | None:
    """The ChatFormatter a chat handler was built from (llama-cpp-python wraps each registered
    format, and each GGUF template, with chat_formatter_to_chat_completion_handler), or None for
    a handler that is not a prompt format (function calling, multimodal)."""
    code = getattr(handler, "__code__", None)
    names = getattr(code, "co_freevars", ())
    if "chat_formatter" not in names or not handler.__closure__:
        return None
    formatter = handler.__closure__[names.index("chat_formatter")].cell_contents
    return formatter if callable(formatter) else None


def renderable_formats(gguf_handlers: Mapping[str, Any] | None = None) -> list[str]:
    """The chat format names gengate can render: llama-cpp-python's registered prompt formats,
    plus the GGUF's templates (`chat_template.*`) when a loaded model's handlers are given."""
    handlers = {**_registered_handlers(), **(gguf_handlers or {})}
    return sorted(name for name, handler in handlers.items() if _formatter_of(handler) is not None)


def check_chat_format_name(name: str, *, model: str) -> None:
    """ConfigError for a name llama-cpp-python does not register, before the model loads; names of
    GGUF templates (`chat_template.*`) are known only after it has (see chat_formatter)."""
    if name.startswith(GGUF_TEMPLATE_PREFIX):
        return
    handlers = _registered_handlers()
    if name not in handlers:
        raise ConfigError(
            f"model {model!r}: chat_format {name!r} is not a llama-cpp-python chat format "
            f"(known: {', '.join(renderable_formats())})"
        )
    if _formatter_of(handlers[name]) is None:
        raise ConfigError(
            f"model {model!r}: chat_format {name!r} is a llama-cpp-python completion handler (function "
            "calling or images), not a prompt format gengate can render "
            f"(formats: {', '.join(renderable_formats())})"
        )


def chat_formatter(name: str, gguf_handlers: Mapping[str, Any], *, model: str) -> ChatFormatter:
    """The formatter for `name`, looked up as llama-cpp-python does (the loaded GGUF's templates
    first, then the registry); ConfigError naming the formats there are."""
    check_chat_format_name(name, model=model)
    handler = gguf_handlers.get(name) or _registered_handlers().get(name)
    formatter = _formatter_of(handler) if handler is not None else None
    if formatter is None:
        raise ConfigError(
            f"model {model!r}: chat_format {name!r} is not among this model's chat formats "
            f"(known: {', '.join(renderable_formats(gguf_handlers))})"
        )
    return formatter


def format_stops(formatter: ChatFormatter) -> tuple[str, ...]:
    """The stop strings a chat format adds to every chat request (chatml: `<|im_end|>`), as
    llama-cpp-python's create_chat_completion adds them; read once from a probe conversation."""
    stop = formatter(messages=[{"role": "user", "content": "x"}]).stop
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)
