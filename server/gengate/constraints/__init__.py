"""Structured-output constraints: lowering to llguidance grammars, compiling, matching, validating."""

from gengate.constraints.compiler import CompiledConstraint, CompilerStats, ConstraintCompiler, constraint_key
from gengate.constraints.lowering import LoweredConstraint, lower
from gengate.constraints.matcher import ConstraintMatcher
from gengate.constraints.tokenizers import make_ll_tokenizer_from_hf, make_ll_tokenizer_from_llama
from gengate.constraints.validation import validate_output

__all__ = [
    "CompiledConstraint",
    "CompilerStats",
    "ConstraintCompiler",
    "ConstraintMatcher",
    "LoweredConstraint",
    "constraint_key",
    "lower",
    "make_ll_tokenizer_from_hf",
    "make_ll_tokenizer_from_llama",
    "validate_output",
]
