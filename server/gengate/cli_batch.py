"""`gengate batch`: durable batch jobs from the command line.

    gengate batch submit --address A --input rows.jsonl [--model M] [request flags] [--offline] [--name N]
    gengate batch status --address A JOB [--json]
    gengate batch list   --address A [--json]
    gengate batch cancel --address A JOB
    gengate batch results --address A JOB --output out.jsonl [--follow]
    gengate batch run    --address A --input rows.jsonl --output out.jsonl [...]

Each input line is a JSON object, parsed by the server (a bad line is that item's error). The
results file holds one line per item in index order; writing into an existing file appends only
the items after its last complete line, so an interrupted download resumes without a duplicate
or a gap. `run` submits with an idempotency key made from the input and the flags, so running the
same command again resumes the same job instead of making another.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from gengate_client import BatchJob, Client, GengateError, ItemResult, Request
from google.protobuf import json_format

from gengate.cli_options import (
    EXIT_RPC_ERROR,
    CliError,
    add_client_options,
    add_request_options,
    call_metadata,
    generate_kwargs,
    print_rpc_error,
)

# How often `--follow` redraws its progress line.
_PROGRESS_EVERY_S = 0.5


def add_batch_commands(sub: Any) -> None:
    """Registers `gengate batch ...` on the top-level subparsers."""
    batch = sub.add_parser("batch", help="durable batch jobs: submit, status, list, cancel, results, run")
    commands = batch.add_subparsers(dest="batch_command", required=True)

    submit = commands.add_parser("submit", help="store a job from a JSONL file; prints its id last")
    add_client_options(submit)
    _add_submit_options(submit)
    submit.set_defaults(func=cmd_submit)

    status = commands.add_parser("status", help="a job's state and counts")
    add_client_options(status)
    status.add_argument("job")
    status.set_defaults(func=cmd_status)

    listing = commands.add_parser("list", help="jobs, newest first")
    add_client_options(listing)
    listing.add_argument("--limit", type=int, default=50)
    listing.set_defaults(func=cmd_list)

    cancel = commands.add_parser("cancel", help="stop a job; unfinished items end CANCELLED")
    add_client_options(cancel)
    cancel.add_argument("job")
    cancel.set_defaults(func=cmd_cancel)

    results = commands.add_parser("results", help="write a job's results as JSONL, resuming a file")
    add_client_options(results)
    results.add_argument("job")
    results.add_argument("--output", required=True, help="JSONL file ('-' for stdout: no resume)")
    results.add_argument("--follow", action="store_true", help="wait for items still running, with progress")
    results.set_defaults(func=cmd_results)

    run = commands.add_parser("run", help="submit (or resume) a job, follow it and write its results")
    add_client_options(run)
    _add_submit_options(run)
    run.add_argument("--output", required=True, help="JSONL results file (resumed when it exists)")
    run.add_argument("--job", help="resume this job instead of submitting")
    run.set_defaults(func=cmd_run)


def _add_submit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    parser.add_argument("--model", help="model for lines that name none")
    parser.add_argument("--name", default="", help="display name")
    parser.add_argument("--key", default="", help="idempotency key: a second submit with it returns the job")
    parser.add_argument("--offline", action="store_true", help="through the provider's batch API")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=0, help="items of this job in flight at once")
    add_request_options(parser)


def _client(args: argparse.Namespace) -> Client:
    metadata = call_metadata(args.metadata or [])
    return Client(args.address, metadata=metadata or None, timeout=args.timeout)


def _lines(path: str) -> list[str]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"--input: cannot read {path}: {exc.strerror}") from exc
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise CliError(f"--input: {path} holds no request")
    return lines


def _defaults(args: argparse.Namespace) -> Request:
    args.messages = None  # lines carry their own input
    args.request_id = None
    kwargs = generate_kwargs(args)
    return Request(model=args.model or "", **{k: v for k, v in kwargs.items() if k != "messages"})


def _submit(client: Client, args: argparse.Namespace, lines: list[str], key: str) -> BatchJob:
    return client.batch_jobs.create(
        jsonl=lines,
        defaults=_defaults(args),
        display_name=args.name,
        idempotency_key=key,
        offline=args.offline,
        priority=args.priority,
        max_concurrency=args.concurrency,
    )


def _job_dict(job: BatchJob) -> dict[str, Any]:
    return {
        "id": job.id,
        "state": job.state,
        "total": job.total,
        "done": job.done,
        "failed": job.failed,
        "name": job.display_name,
        "created": job.create_time.isoformat() if job.create_time else None,
        "started": job.start_time.isoformat() if job.start_time else None,
        "finished": job.end_time.isoformat() if job.end_time else None,
        "usage": {"input_tokens": job.usage.input_tokens, "output_tokens": job.usage.output_tokens},
        "offline": job.offline,
        "error": job.error,
    }


def _describe(job: BatchJob) -> str:
    line = f"{job.id}  {job.state:<9}  {job.done}/{job.total} done, {job.failed} failed"
    return line + (f"  {job.display_name}" if job.display_name else "")


def _guarded(run: Any) -> int:
    try:
        status: int = run()
    except GengateError as exc:
        print_rpc_error(exc, sys.stderr)
        return EXIT_RPC_ERROR
    return status


def cmd_submit(args: argparse.Namespace) -> int:
    lines = _lines(args.input)

    def run() -> int:
        with _client(args) as client:
            job = _submit(client, args, lines, args.key)
        print(f"submitted {job.total} items", file=sys.stderr)
        print(job.id)
        return 0

    return _guarded(run)


def cmd_status(args: argparse.Namespace) -> int:
    def run() -> int:
        with _client(args) as client:
            job = client.batch_jobs.get(args.job)
        print(json.dumps(_job_dict(job)) if args.json else _describe(job))
        return 0

    return _guarded(run)


def cmd_list(args: argparse.Namespace) -> int:
    def run() -> int:
        with _client(args) as client:
            jobs = [job for _, job in zip(range(args.limit), client.batch_jobs.list(), strict=False)]
        for job in jobs:
            print(json.dumps(_job_dict(job)) if args.json else _describe(job))
        return 0

    return _guarded(run)


def cmd_cancel(args: argparse.Namespace) -> int:
    def run() -> int:
        with _client(args) as client:
            job = client.batch_jobs.cancel(args.job)
        print(json.dumps(_job_dict(job)) if args.json else _describe(job))
        return 0

    return _guarded(run)


def cmd_results(args: argparse.Namespace) -> int:
    return _guarded(lambda: _download(args, args.job))


def cmd_run(args: argparse.Namespace) -> int:
    lines = _lines(args.input)

    def run() -> int:
        job_id = args.job
        if job_id is None:
            key = args.key or _run_key(lines, args)
            with _client(args) as client:
                job = _submit(client, args, lines, key)
            print(f"job {job.id}: {job.total} items", file=sys.stderr)
            job_id = job.id
        args.follow = True
        status = _download(args, job_id)
        print(job_id)
        return status

    return _guarded(run)


def _run_key(lines: list[str], args: argparse.Namespace) -> str:
    """The same input and flags make the same key: a re-run resumes its job."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode())
        digest.update(b"\n")
    flags = {
        k: v for k, v in sorted(vars(args).items()) if k not in ("func", "output", "address", "metadata")
    }
    digest.update(json.dumps(flags, default=str, sort_keys=True).encode())
    return "run-" + digest.hexdigest()[:32]


def _resume_point(path: Path) -> int | None:
    """The index of the last complete line of an existing results file (cutting a line the last
    run left half-written), or None for a new file."""
    if not path.exists():
        return None
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    last = data[:end].rstrip(b"\n").rsplit(b"\n", 1)[-1]
    if not last:
        return None
    try:
        return int(json.loads(last)["index"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CliError(f"--output: {path} is not a results file of this command ({exc})") from exc


def _result_line(item: ItemResult) -> str:
    if item.error is None:
        assert item.response is not None
        response = json_format.MessageToDict(item.response.raw)
        return json.dumps({"index": item.index, "response": response}, ensure_ascii=False)
    error = item.error
    body: dict[str, Any] = {"message": str(error)}
    if isinstance(error, GengateError):
        body = {"code": error.code_name, "message": error.message, "reason": error.reason}
    return json.dumps({"index": item.index, "error": body}, ensure_ascii=False)


def _download(args: argparse.Namespace, job_id: str) -> int:
    to_stdout = args.output == "-"
    path = Path(args.output)
    after = None if to_stdout else _resume_point(path)
    with _client(args) as client:
        job = client.batch_jobs.get(job_id)
        progress = _Progress(job.total, 0 if after is None else after + 1, enabled=args.follow)
        out: TextIO = sys.stdout if to_stdout else path.open("a", encoding="utf-8")
        try:
            for item in _items(client, job_id, after, args.follow):
                out.write(_result_line(item) + "\n")
                out.flush()
                progress.update(item)
        finally:
            progress.close()
            if not to_stdout:
                out.close()
        job = client.batch_jobs.get(job_id)
    print(_describe(job), file=sys.stderr)
    return 0


def _items(client: Client, job_id: str, after: int | None, follow: bool) -> Iterator[ItemResult]:
    yield from client.batch_jobs.results(job_id, after_index=after, follow=follow)


class _Progress:
    """done/total, rate and ETA on stderr while following a job."""

    def __init__(self, total: int, already: int, *, enabled: bool) -> None:
        self.total, self.done, self.failed = total, already, 0
        self.enabled = enabled
        self.began = time.monotonic()
        self.first = already
        self.drawn_at = 0.0

    def update(self, item: ItemResult) -> None:
        self.done += 1
        self.failed += 0 if item.ok else 1
        now = time.monotonic()
        if self.enabled and (now - self.drawn_at >= _PROGRESS_EVERY_S or self.done >= self.total):
            self.drawn_at = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.began, 1e-9)
        rate = (self.done - self.first) / elapsed
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 and left > 0 else "-"
        sys.stderr.write(
            f"\rbatch: {self.done}/{self.total} done, {self.failed} failed, {rate:.1f} items/s, ETA {eta}  "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
