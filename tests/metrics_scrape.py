"""Reading a server's Prometheus endpoint in tests: scrape it over HTTP, parse it with
prometheus_client's own parser, and look samples up by name and labels."""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from gengate.api.server import RunningServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class Scrape:
    """One scrape: the raw text and every sample in it."""

    text: str
    samples: list[Sample]
    types: dict[str, str]  # family name -> counter, gauge, histogram, ...

    def values(self, name: str, **labels: str) -> list[float]:
        """The values of the samples called `name` whose labels include `labels`."""
        return [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of those samples (0 when there are none: a series never touched)."""
        return sum(self.values(name, **labels))

    def label_values(self, name: str, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name == name and label in s.labels}


def scrape_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text: str = response.read().decode()
    return text


def parse(text: str) -> Scrape:
    families = list(text_string_to_metric_families(text))
    return Scrape(text, [s for f in families for s in f.samples], {f.name: f.type for f in families})


async def scrape(server: RunningServer) -> Scrape:
    """The server's endpoint, read over HTTP (off the event loop: the server runs on it)."""
    address = server.metrics_address
    assert address is not None, "the server has no metrics endpoint (server.metrics.port)"
    return parse(await asyncio.to_thread(scrape_text, address))
