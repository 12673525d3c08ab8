"""buf plugins in one file, so one buf.gen.yaml generates Python, Go and TypeScript.

Default mode runs grpc_tools.protoc on buf's request: it writes the request's descriptors to a
descriptor set, emits the message, gRPC and mypy stubs for the gengate/ files as the public
package ``gengate_proto`` (``gengate/v1/x.proto`` -> ``gengate_proto.v1.x_pb2``, imported by both
the server and the client SDK) and answers with every file, ``__init__.py`` and ``py.typed``
included. ``--filter PREFIX PLUGIN...`` instead passes the request to another plugin with only
the files under PREFIX to generate (google/rpc stays an import, never generated code).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2

PACKAGE = "gengate_proto"
_FROM = re.compile(r"^from gengate\.v1 import", re.M)
_IMPORT = re.compile(r"^import gengate\.v1\.([a-z_]+_pb2)", re.M)


def _rewrite(text: str) -> str:
    """Makes generated imports of gengate.v1 absolute in the gengate_proto package."""
    text = _FROM.sub(f"from {PACKAGE}.v1 import", text)
    return _IMPORT.sub(rf"import {PACKAGE}.v1.\1", text)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _strip_default_json_names(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    """Drops json_name values protoc would not embed, so output matches plain protoc's."""

    def walk(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            if field.json_name == _camel(field.name):
                field.ClearField("json_name")
        for nested in message.nested_type:
            walk(nested)

    for file in files:
        for message in file.message_type:
            walk(message)


def _python(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    targets = [f for f in request.file_to_generate if f.startswith("gengate/")]
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    if not targets:
        return response
    files = list(request.proto_file)
    _strip_default_json_names(files)
    with tempfile.TemporaryDirectory() as tmp:
        descriptors = Path(tmp, "set.binpb")
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=files).SerializeToString())
        out = Path(tmp, "out")
        out.mkdir()
        flags = [f"--{kind}_out={out}" for kind in ("python", "grpc_python", "mypy", "mypy_grpc")]
        argv = [sys.executable, "-m", "grpc_tools.protoc", f"--descriptor_set_in={descriptors}"]
        run = subprocess.run([*argv, *flags, *targets], capture_output=True, text=True, check=False)
        if run.returncode != 0:
            response.error = run.stderr or "grpc_tools.protoc failed"
            return response
        packages = {"__init__.py"}
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            name = path.relative_to(out / "gengate").as_posix()  # gengate/v1/x -> v1/x
            response.file.add(name=name, content=_rewrite(path.read_text()))
            parts = name.split("/")[:-1]
            packages.update("/".join(parts[: i + 1]) + "/__init__.py" for i in range(len(parts)))
        for name in sorted(packages):
            response.file.add(name=name, content="")
        response.file.add(name="py.typed", content="")  # PEP 561: the .pyi stubs are the types
    return response


def _filter(raw: bytes, prefix: str, plugin: list[str]) -> bytes:
    request = plugin_pb2.CodeGeneratorRequest.FromString(raw)
    kept = [f for f in request.file_to_generate if f.startswith(prefix)]
    del request.file_to_generate[:]
    request.file_to_generate.extend(kept)
    return subprocess.run(plugin, input=request.SerializeToString(), capture_output=True, check=True).stdout


def main() -> None:
    raw = sys.stdin.buffer.read()
    if sys.argv[1:2] == ["--filter"]:
        sys.stdout.buffer.write(_filter(raw, sys.argv[2], sys.argv[3:]))
        return
    request = plugin_pb2.CodeGeneratorRequest.FromString(raw)
    sys.stdout.buffer.write(_python(request).SerializeToString())


if __name__ == "__main__":
    main()
