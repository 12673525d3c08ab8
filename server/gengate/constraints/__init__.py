"""Structured-output constraints: one spec per kind (kinds), lowering to llguidance grammars,
compiling, matching, validating."""

from gengate.constraints.compiler import CompiledConstraint, CompilerStats, ConstraintCompiler, constraint_key
from gengate.constraints.kinds import (
    SPECS,
    ConstraintSpec,
    cheap_to_validate,
    check_constraint_syntax,
    field_of,
    lower,
    spec_of,
    validate_output,
)
from gengate.constraints.lowering import LoweredConstraint
from gengate.constraints.matcher import ConstraintMatcher
from gengate.constraints.tokenizers import make_ll_tokenizer_from_hf, make_ll_tokenizer_from_llama

__all__ = [
    "SPECS",
    "CompiledConstraint",
    "CompilerStats",
    "ConstraintCompiler",
    "ConstraintMatcher",
    "ConstraintSpec",
    "LoweredConstraint",
    "cheap_to_validate",
    "check_constraint_syntax",
    "constraint_key",
    "field_of",
    "lower",
    "make_ll_tokenizer_from_hf",
    "make_ll_tokenizer_from_llama",
    "spec_of",
    "validate_output",
]
