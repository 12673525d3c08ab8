"""A loopback Anthropic Message Batches API on top of FakeAnthropic: POST /v1/messages/batches,
GET /v1/messages/batches/{id}, GET /v1/messages/batches/{id}/results (JSONL, at the batch's
`results_url`), POST /v1/messages/batches/{id}/cancel.

Each request's `params` is answered by the same logic as the fake's /v1/messages (`answers`
consumed in request order). A batch stays `in_progress` while `hold` is set; the first retrieve
after that ends it. `request_errors` (custom_id -> Anthropic error type) make those requests
`errored`; `next_outcome = "expired"` expires the next batch's requests. A cancelled batch's
unprocessed requests end `canceled`. Shapes as Anthropic documents them: a result line is
{custom_id, result: {type: succeeded, message} | {type: errored, error} | {type: canceled} |
{type: expired}}.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from fake_anthropic import FakeAnthropic
from fakehttp import Json, Raw, Recorded

_ids = itertools.count(1)
CREATED = "2025-01-01T00:00:00Z"
EXPIRES = "2025-01-02T00:00:00Z"
ENDED = "2025-01-01T01:00:00Z"


def _error(message: str, status: int = 404, kind: str = "not_found_error") -> Json:
    return Json({"type": "error", "error": {"type": kind, "message": message}}, status=status)


class FakeAnthropicBatches(FakeAnthropic):
    """FakeAnthropic plus Message Batches; records every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.server.add_route("POST", "/v1/messages/batches", self._create)
        self.server.add_route("GET", "/v1/messages/batches/{batch_id}", self._retrieve)
        self.server.add_route("GET", "/v1/messages/batches/{batch_id}/results", self._results)
        self.server.add_route("POST", "/v1/messages/batches/{batch_id}/cancel", self._cancel)
        self.reset_batches()

    def reset_batches(self) -> None:
        self.batches: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, list[dict[str, Any]]] = {}  # batch id -> its requests
        self.outputs: dict[str, list[dict[str, Any]]] = {}  # batch id -> its result lines
        self.hold = False
        self.request_errors: dict[str, str] = {}
        self.next_outcome: str | None = None
        self.cancels: list[str] = []

    def reset(self) -> None:
        super().reset()
        self.reset_batches()

    @property
    def creates(self) -> int:
        return len(self.batches)

    def _create(self, rec: Recorded) -> Json:
        requests = (rec.body or {}).get("requests") or []
        ids = [r.get("custom_id") for r in requests]
        if not requests or len(set(ids)) != len(ids):
            return _error(
                "requests must be non-empty with unique custom_id values", 400, "invalid_request_error"
            )
        batch_id = f"msgbatch_{next(_ids):04d}"
        self.inputs[batch_id] = requests
        batch = {
            "id": batch_id,
            "type": "message_batch",
            "processing_status": "in_progress",
            "request_counts": {
                "processing": len(requests),
                "succeeded": 0,
                "errored": 0,
                "canceled": 0,
                "expired": 0,
            },
            "created_at": CREATED,
            "expires_at": EXPIRES,
            "ended_at": None,
            "cancel_initiated_at": None,
            "archived_at": None,
            "results_url": None,
            "expire": self.next_outcome == "expired",
        }
        self.next_outcome = None
        self.batches[batch_id] = batch
        return Json(self._public(batch))

    @staticmethod
    def _public(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in batch.items() if k != "expire"}

    def _retrieve(self, rec: Recorded) -> Json:
        batch = self.batches.get(rec.path.split("/")[-1])
        if batch is None:
            return _error("batch not found")
        if batch["processing_status"] == "canceling" or (
            batch["processing_status"] == "in_progress" and not self.hold
        ):
            self._end(batch)
        return Json(self._public(batch))

    def _end(self, batch: dict[str, Any]) -> None:
        cancelled = batch["processing_status"] == "canceling"
        lines: list[dict[str, Any]] = []
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for request in self.inputs[batch["id"]]:
            cid = request["custom_id"]
            result: dict[str, Any]
            if cancelled:
                result, kind = {"type": "canceled"}, "canceled"
            elif batch["expire"]:
                result, kind = {"type": "expired"}, "expired"
            elif cid in self.request_errors:
                error = {"type": self.request_errors[cid], "message": f"request {cid} was refused"}
                result, kind = {"type": "errored", "error": {"type": "error", "error": error}}, "errored"
            else:
                reply = self._messages(Recorded("POST", "/v1/messages", {}, {}, request["params"]))
                assert isinstance(reply, Json)
                result, kind = {"type": "succeeded", "message": reply.body}, "succeeded"
            counts[kind] += 1
            lines.append({"custom_id": cid, "result": result})
        self.outputs[batch["id"]] = lines
        batch.update(
            processing_status="ended",
            request_counts=counts,
            ended_at=ENDED,
            results_url=f"{self.server.base_url}/v1/messages/batches/{batch['id']}/results",
        )

    def _results(self, rec: Recorded) -> Json | Raw:
        batch_id = rec.path.split("/")[-2]
        if batch_id not in self.outputs:
            return _error("the batch has not ended", 404)
        body = "".join(json.dumps(line) + "\n" for line in self.outputs[batch_id]).encode()
        return Raw(body, "application/binary")

    def _cancel(self, rec: Recorded) -> Json:
        batch_id = rec.path.split("/")[-2]
        batch = self.batches.get(batch_id)
        if batch is None:
            return _error("batch not found")
        self.cancels.append(batch_id)
        if batch["processing_status"] == "in_progress":
            batch.update(processing_status="canceling", cancel_initiated_at=ENDED)
        return Json(self._public(batch))
