"""A loopback OpenAI Files + Batch API on top of FakeOpenAI: POST /v1/files (multipart upload,
`purpose=batch`), GET /v1/files/{id}/content, POST /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel, and Azure's variants under /openai/... (with an api-version query).

Each line of a batch's input file is answered by the same logic as the fake's chat completions
(`answers` consumed in line order), so structured answers can be scripted valid or invalid.
A batch stays `in_progress` while `hold` is set; the first retrieve after that processes it:
answered lines go to the output file, `line_errors` (by custom_id) to the error file. Faults for
the next batch: `next_outcome = "failed" | "expired"`. Shapes as OpenAI documents them: an
output line is {id, custom_id, response: {status_code, request_id, body}, error}.
"""

from __future__ import annotations

import itertools
import json
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from fake_openai import FakeOpenAI
from fakehttp import Json, Raw, Recorded

_ids = itertools.count(1)
NOW = 1_700_000_000


def _error(message: str, status: int = 400, code: str | None = None) -> Json:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return Json(body, status=status)


def multipart(rec: Recorded) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body as {field: (filename, bytes)}."""
    head = f"Content-Type: {rec.headers.get('content-type', '')}\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + rec.raw)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        fields[str(name)] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


class FakeOpenAIBatches(FakeOpenAI):
    """FakeOpenAI plus the Files and Batch APIs; records every batch and file."""

    def __init__(self) -> None:
        super().__init__()
        for prefix in ("/v1", "/openai"):
            self.server.add_route("POST", f"{prefix}/files", self._upload)
            self.server.add_route("GET", f"{prefix}/files/{{file_id}}/content", self._content)
            self.server.add_route("POST", f"{prefix}/batches", self._create)
            self.server.add_route("GET", f"{prefix}/batches/{{batch_id}}", self._retrieve)
            self.server.add_route("POST", f"{prefix}/batches/{{batch_id}}/cancel", self._cancel)
        self.reset_batches()

    def reset_batches(self) -> None:
        self.files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, content)
        self.batches: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, list[dict[str, Any]]] = {}  # batch id -> its input lines
        self.hold = False
        self.line_errors: dict[str, dict[str, Any]] = {}  # custom_id -> its error line's response
        self.next_outcome: str | None = None
        self.cancels: list[str] = []
        self.retrieves = 0

    def reset(self) -> None:
        super().reset()
        self.reset_batches()

    @property
    def creates(self) -> int:
        return len(self.batches)

    @staticmethod
    def _azure(rec: Recorded) -> bool:
        return rec.path.startswith("/openai/")

    def _checked(self, rec: Recorded) -> Json | None:
        if self._azure(rec) and not rec.query.get("api-version"):
            return _error("Missing required query parameter: api-version", 404)
        return None

    def _upload(self, rec: Recorded) -> Json:
        refused = self._checked(rec)
        if refused is not None:
            return refused
        fields = multipart(rec)
        purpose = fields.get("purpose", (None, b""))[1].decode()
        filename, content = fields.get("file", (None, b""))
        if purpose != "batch" or not filename or not filename.endswith(".jsonl"):
            return _error(f"a batch input is a .jsonl file with purpose batch, not {purpose!r} {filename!r}")
        file_id = f"file-{next(_ids)}"
        self.files[file_id] = (purpose, content)
        return Json(
            {
                "id": file_id,
                "object": "file",
                "bytes": len(content),
                "created_at": NOW,
                "filename": filename,
                "purpose": purpose,
                "status": "processed",
            }
        )

    def _content(self, rec: Recorded) -> Json | Raw:
        refused = self._checked(rec)
        if refused is not None:
            return refused
        file_id = rec.path.split("/")[-2]
        if file_id not in self.files:
            return _error(f"No such File object: {file_id}", 404)
        return Raw(self.files[file_id][1], "application/octet-stream")

    def _create(self, rec: Recorded) -> Json:
        refused = self._checked(rec)
        if refused is not None:
            return refused
        body: dict[str, Any] = rec.body
        file_id = body.get("input_file_id")
        if file_id not in self.files:
            return _error(f"No such File object: {file_id}", 404)
        if body.get("completion_window") != "24h":
            return _error("completion_window must be 24h")
        batch_id = f"batch_{next(_ids)}"
        lines = [json.loads(line) for line in self.files[file_id][1].decode().splitlines() if line.strip()]
        self.inputs[batch_id] = lines
        batch: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body.get("endpoint"),
            "errors": None,
            "input_file_id": file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": NOW,
            "expires_at": NOW + 86400,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        # The endpoint must be the API's own (Azure: /chat/completions), and every line's url it.
        want = "/chat/completions" if self._azure(rec) else "/v1/chat/completions"
        problems = [
            f"line {n + 1}: url {line.get('url')!r} is not the batch endpoint {want!r}"
            for n, line in enumerate(lines)
            if line.get("url") != want or line.get("method") != "POST"
        ]
        if body.get("endpoint") != want:
            problems.insert(0, f"endpoint {body.get('endpoint')!r} is not {want!r}")
        if len({line.get("custom_id") for line in lines}) != len(lines):
            problems.append("custom_id values must be unique")
        if problems or self.next_outcome == "failed":
            data = [{"code": "invalid_request", "message": p, "param": None, "line": None} for p in problems]
            data = data or [
                {"code": "token_limit_exceeded", "message": "Enqueued token limit reached.", "line": None}
            ]
            batch.update(status="failed", errors={"object": "list", "data": data}, failed_at=NOW)
            self.next_outcome = None
        elif self.next_outcome == "expired":
            batch["expire"] = True
            self.next_outcome = None
        self.batches[batch_id] = batch
        return Json(self._public(batch))

    @staticmethod
    def _public(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in batch.items() if k != "expire"}

    def _retrieve(self, rec: Recorded) -> Json:
        refused = self._checked(rec)
        if refused is not None:
            return refused
        batch = self.batches.get(rec.path.split("/")[-1])
        if batch is None:
            return _error("No such batch", 404)
        self.retrieves += 1
        if batch["status"] == "validating":
            batch["status"] = "in_progress"
        elif batch["status"] == "cancelling":
            batch.update(status="cancelled", cancelled_at=NOW)
        elif batch["status"] == "in_progress" and not self.hold:
            self._process(batch)
        return Json(self._public(batch))

    def _process(self, batch: dict[str, Any]) -> None:
        output: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for n, line in enumerate(self.inputs[batch["id"]]):
            cid = line["custom_id"]
            entry: dict[str, Any] = {
                "id": f"batch_req_{n}",
                "custom_id": cid,
                "response": None,
                "error": None,
            }
            if batch.get("expire"):
                message = "This request could not be executed before the completion window expired."
                entry["error"] = {"code": "batch_expired", "message": message}
                failed.append(entry)
            elif cid in self.line_errors:
                entry["response"] = {"request_id": f"req_{n}", **self.line_errors[cid]}
                failed.append(entry)
            else:
                reply = self._chat(Recorded("POST", line["url"], {}, {}, line["body"]))
                assert isinstance(reply, Json)
                entry["response"] = {
                    "status_code": reply.status,
                    "request_id": f"req_{n}",
                    "body": reply.body,
                }
                output.append(entry)
        for kind, entries in (("output_file_id", output), ("error_file_id", failed)):
            if entries:
                file_id = f"file-{next(_ids)}"
                self.files[file_id] = (
                    "batch_output",
                    "".join(json.dumps(e) + "\n" for e in entries).encode(),
                )
                batch[kind] = file_id
        counts = {"total": len(output) + len(failed), "completed": len(output), "failed": len(failed)}
        status = "expired" if batch.get("expire") else "completed"
        batch.update(status=status, request_counts=counts, completed_at=NOW)

    def _cancel(self, rec: Recorded) -> Json:
        refused = self._checked(rec)
        if refused is not None:
            return refused
        batch_id = rec.path.split("/")[-2]
        batch = self.batches.get(batch_id)
        if batch is None:
            return _error("No such batch", 404)
        self.cancels.append(batch_id)
        if batch["status"] not in ("validating", "in_progress"):
            return _error(f"Cannot cancel a batch with status {batch['status']}.")
        batch.update(status="cancelling", cancelling_at=NOW)
        return Json(self._public(batch))
