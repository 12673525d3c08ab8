"""What callers + every quota + metrics cost per call, counted in instructions, not timed: the
same unary calls on the model-free `scripted` echo through `gengate serve` run under valgrind's
callgrind, bare and with operations on (as bench/operations_overhead.py). Counting is switched on
(`callgrind_control -i on`) only after start-up and 96 warm-up calls, and off after the measured
calls, so the total over the calls is the server's user-space instructions per call.

The count moves far less with the load of a shared machine than CPU time does (up to ~2% when
the machine is busy, as gRPC's threads poll while they wait: run before/after in one quiet
sitting), so a change of a few percent shows; it leaves out the kernel's share of each call
(sockets), which both variants pay alike, so the ratio here is an upper bound of the CPU-time
ratio. Metrics are scraped once per 1,000 calls (about once a second at the native rate).
Needs valgrind (`apt-get install valgrind`); each server runs ~50x slower under it (a few minutes
in all). `--repo DIR` measures another checkout's server (a before/after in one sitting).

    .venv/bin/python bench/instructions_overhead.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml
from callers import LIMITED, MODELS, TOKEN, TOKEN_VARIABLE
from common import REPO, _wait_serving
from metrics_overhead import free_port

SCRAPE_EVERY = 1000


def counting(pid: int, on: bool) -> None:
    """Switches callgrind's counting in process `pid` on or off."""
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(pid)], check=True, capture_output=True
    )


async def drive(address: str, pid: int, operations: bool, calls: int, metrics_port: int) -> int:
    """96 warm-up calls, then `calls` counted (8 at a time, metrics scraped every SCRAPE_EVERY);
    the calls counted."""
    from gengate_client import AsyncClient

    metadata = (("authorization", f"Bearer {TOKEN}"),) if operations else ()
    served = -96
    async with AsyncClient(address, metadata=metadata) as client:
        while served < calls:
            if served == 0:
                counting(pid, True)
            await asyncio.gather(*(client.generate("echo", "hello world", max_tokens=8) for _ in range(8)))
            served += 8
            if operations and served > 0 and served % SCRAPE_EVERY < 8:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=300) as page:
                    page.read()
    counting(pid, False)
    return served


async def instructions(repo: Path, operations: bool, calls: int) -> tuple[int, int]:
    """The instructions callgrind counted over the measured calls of one server run, and the calls."""
    with tempfile.TemporaryDirectory(prefix="gengate-callgrind-") as tmp:
        port = free_port()
        document: dict[str, object] = {"models": MODELS}
        if operations:
            document["callers"] = LIMITED
            document["server"] = {"metrics": {"port": port, "host": "127.0.0.1"}}
        Path(tmp, "config.yaml").write_text(yaml.safe_dump(document))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0", "GENGATE_DATA_DIR": tmp}
        env[TOKEN_VARIABLE] = TOKEN
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.out"]
        command += [sys.executable, "-m", "gengate", "serve", "--config", f"{tmp}/config.yaml", "--port", "0"]
        with open(Path(tmp, "server.log"), "w+") as log:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**env, "PYTHONPATH": f"{repo}/server:{repo}/clients/python"},
                cwd=repo,
            )
            try:
                address = _wait_serving(proc, log, 900)
                served = await drive(address, proc.pid, operations, calls, port)
            finally:
                proc.terminate()
                proc.wait(timeout=600)
            log.seek(0)
            found = re.search(r"Collected : (\d+)", log.read())
        if found is None:
            raise RuntimeError("callgrind printed no instruction count (is valgrind working?)")
        return int(found.group(1)), served


async def run(repo: Path, calls: int) -> None:
    per_call: dict[str, float] = {}
    for name, operations in (("bare", False), ("callers+quotas+metrics", True)):
        total, counted = await instructions(repo, operations, calls)
        per_call[name] = total / counted
        print(f"{name}: {per_call[name]:,.0f} instructions per call", flush=True)
    bare, full = per_call["bare"], per_call["callers+quotas+metrics"]
    print(f"\nSUMMARY instructions per call ÷ bare: {full / bare:.3f} (+{full - bare:,.0f} a call)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2000, help="calls counted per variant (2000)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server runs (this one)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    asyncio.run(run(args.repo.resolve(), args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
