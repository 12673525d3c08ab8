"""One spec per constraint kind (gengate.constraints.kinds): every kind has one, its fields are the
contract's, and no other module tells kinds apart by their classes (backends' native mappings
aside), so adding a kind is one spec."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest
from gengate import domain
from gengate.constraints.examples import EXAMPLE_CONSTRAINTS
from gengate.constraints.kinds import SPECS, spec_of
from gengate.domain import ConstraintKind, StructuredOutput
from gengate_proto.v1 import generation_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "server" / "gengate"
TYPES_PROTO = ROOT / "proto" / "gengate" / "v1" / "types.proto"

CONSTRAINT_CLASSES = {cls.__name__ for cls in typing.get_args(domain.Constraint)}

# Modules that may tell constraint kinds apart by class: the specs, the domain itself, the one
# proto conversion, and the backends' tables of what each serves natively, and how.
MAY_DISPATCH = ("gengate.constraints.kinds", "gengate.domain", "gengate.api.convert")
BACKEND_MAPPINGS = ("gengate.providers", "gengate.engines")
# Where kinds were told apart before the specs: these must be among the modules scanned.
FORMERLY_DISPATCHING = (
    "gengate.checks",
    "gengate.limits",
    "gengate.constraints.lowering",
    "gengate.constraints.validation",
    "gengate.constraints.syntax",
    "gengate.constraints.compiler",
    "gengate.constraints.sandbox",
)


def test_every_kind_has_exactly_one_spec_for_its_class() -> None:
    assert set(SPECS) == set(ConstraintKind)
    classes = []
    for kind, spec in SPECS.items():
        assert spec.kind is kind
        default_kind = {f.name: f.default for f in dataclasses.fields(spec.constraint_type)}["kind"]
        assert default_kind is kind
        classes.append(spec.constraint_type.__name__)
    assert sorted(classes) == sorted(CONSTRAINT_CLASSES)


def _proto_field(path: str) -> FieldDescriptor:
    """The field a request path names (relative to GenerateRequest), or AssertionError."""
    message: Descriptor = generation_pb2.GenerateRequest.DESCRIPTOR
    found: FieldDescriptor | None = None
    for name in path.split("."):
        assert message is not None, f"{path}: {name} is inside a field that is not a message"
        assert name in message.fields_by_name, f"{path}: {message.full_name} has no field {name}"
        found = message.fields_by_name[name]
        message = found.message_type
    assert found is not None
    return found


@pytest.mark.parametrize("kind", list(ConstraintKind), ids=str)
def test_a_specs_fields_are_fields_of_the_contract(kind: ConstraintKind) -> None:
    spec = SPECS[kind]
    oneof = generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[
        "structured_output"
    ].message_type.oneofs_by_name["kind"]
    field = _proto_field(spec.field)
    assert field.containing_oneof is oneof
    assert field.name == kind.value  # the oneof member is named as the kind
    content = _proto_field(spec.content_field)
    if kind is ConstraintKind.JSON_OBJECT:
        # JsonObject has no fields; its refusals have always named the schema field.
        assert field.message_type.fields == []
        assert spec.content_field == SPECS[ConstraintKind.JSON_SCHEMA].content_field
    else:
        assert spec.content_field.startswith(spec.field + ".")
        assert content.containing_type is field.message_type
    assert re.fullmatch(r"[A-Z_]+", spec.invalid_reason)


def test_the_proto_oneof_is_exactly_the_specs() -> None:
    """Read from types.proto itself: a member added there without a spec (or the reverse) fails."""
    text = TYPES_PROTO.read_text()
    block = re.search(r"message StructuredOutput \{\s*oneof kind \{(.*?)\}", text, re.S)
    assert block is not None
    members = set(re.findall(r"^\s*\w+\s+(\w+)\s*=\s*\d+;", block.group(1), re.M))
    assert members == {spec.field.removeprefix("structured_output.") for spec in SPECS.values()}


@pytest.mark.parametrize("name", sorted(EXAMPLE_CONSTRAINTS))
def test_spec_of_answers_for_a_structured_output_a_constraint_and_a_kind(name: str) -> None:
    constraint = EXAMPLE_CONSTRAINTS[name]
    structured = StructuredOutput(constraint)
    spec = spec_of(structured)
    assert spec is spec_of(constraint) is spec_of(constraint.kind)
    assert spec.constraint(structured) is constraint
    assert spec.lower(structured).kind is spec.kind
    assert spec.instructions(structured)
    other = next(s for s in SPECS.values() if s is not spec)
    with pytest.raises(TypeError):
        other.constraint(structured)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _class_checks(path: Path) -> list[str]:
    """Every isinstance(..., <constraint class>) and `case <constraint class>(...)` in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            named = _names(node.args[1]) & CONSTRAINT_CLASSES
        elif isinstance(node, ast.MatchClass):
            named = _names(node.cls) & CONSTRAINT_CLASSES
        else:
            continue
        found += [f"{path.name}:{node.lineno} {name}" for name in sorted(named)]
    return found


def test_no_module_tells_constraint_kinds_apart_by_class_but_the_specs() -> None:
    modules = _modules()
    scanned = {
        module
        for module in modules
        if module not in MAY_DISPATCH
        and not any(module == m or module.startswith(m + ".") for m in BACKEND_MAPPINGS)
    }
    assert set(FORMERLY_DISPATCHING) <= scanned
    offenders = {module: _class_checks(modules[module]) for module in sorted(scanned)}
    assert {module: found for module, found in offenders.items() if found} == {}


def test_the_scan_sees_class_checks() -> None:
    assert _class_checks(PACKAGE / "api" / "convert.py")
    assert _class_checks(PACKAGE / "providers" / "structured.py")


def test_the_metaschema_check_runs_once_per_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox checks the syntax, then lowers without checking the metaschema again; lowering
    on its own (an engine's compiler, the benchmark) checks it itself."""
    from gengate.constraints import lower, lowering
    from gengate.constraints.sandbox import judge

    calls: list[object] = []
    real = lowering.check_schema

    def counted(schema: object, field: str) -> None:
        calls.append(schema)
        real(schema, field)

    monkeypatch.setattr(lowering, "check_schema", counted)
    structured = StructuredOutput(EXAMPLE_CONSTRAINTS["json_schema"])
    assert judge(structured, trial_compile=True).error is None
    assert len(calls) == 1
    lower(structured)
    assert len(calls) == 2
    refused = judge(StructuredOutput(domain.JsonSchemaConstraint({"type": "objekt"})), trial_compile=True)
    assert refused.error is not None and refused.error[1] == "INVALID_SCHEMA"
    assert len(calls) == 3
