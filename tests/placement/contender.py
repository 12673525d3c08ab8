"""A placement contender run as its own OS process by the placement tests.

usage: contender.py PLACEMENT_FILE NAME GPUS MODE [ARGS]
  hold N        acquire N one-GPU leases (devices: auto), print them as JSON, hold until stdin closes
  churn ROUNDS  acquire/check/release one lease ROUNDS times; print the overlaps seen (JSON list)
  die           acquire one lease, print it, and exit without releasing (os._exit)
"""

from __future__ import annotations

import json
import os
import sys

from gengate.workers.placement import PlacementError, PlacementFile, StaticDeviceProvider


def main() -> None:
    path, name, gpus, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    placement = PlacementFile(path, server_id=name)
    provider = StaticDeviceProvider.fake(gpus)
    if mode == "hold":
        held = []
        for i in range(int(sys.argv[5])):
            try:
                held.append(list(placement.acquire(f"{name}-m{i}", provider).devices))
            except PlacementError as exc:
                held.append(exc.reason)
        print(json.dumps(held), flush=True)
        sys.stdin.read()
    elif mode == "churn":
        overlaps = []
        for i in range(int(sys.argv[5])):
            lease = placement.acquire(f"{name}-r{i}", provider)
            seen: dict[int, str] = {}
            for other in placement.leases():
                for device in other.devices:
                    if device in seen:
                        overlaps.append([device, seen[device], other.model])
                    seen[device] = other.model
            placement.release(lease)
        print(json.dumps(overlaps), flush=True)
    elif mode == "die":
        lease = placement.acquire(f"{name}-dies", provider)
        print(json.dumps(list(lease.devices)), flush=True)
        os._exit(0)


if __name__ == "__main__":
    main()
