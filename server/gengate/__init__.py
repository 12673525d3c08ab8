"""gengate: one gRPC service for text and typed structured output from any LLM."""

from gengate.compiled import install as _install_compiled_guard

_install_compiled_guard()
