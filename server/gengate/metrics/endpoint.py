"""The metrics endpoint: an HTTP server on a daemon thread that answers a scrape with the
server's registry in Prometheus text.

The common scrape (text format 0.0.4, the whole registry) writes the recorded families itself
(families.Metrics.text: the same bytes as prometheus_client, ~1/18 of its time) and the
scrape-time collectors through prometheus_client; OpenMetrics, text 1.0 and `name[]`
selections go to prometheus_client's own app unchanged.
"""

from __future__ import annotations

import gzip
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, gzip_accepted

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def metrics_app(registry: CollectorRegistry, recorded: Callable[[], str], others: CollectorRegistry) -> App:
    """The WSGI app: `recorded()` (the text of the families `registry` holds that are recorded as
    calls end) then `others` (its scrape-time collectors) for a plain text scrape; `registry`
    through prometheus_client for anything else."""
    general: App = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        encoder, _ = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        plain = encoder is generate_latest and "name[]" not in parse_qs(environ.get("QUERY_STRING", ""))
        if not plain or environ.get("REQUEST_METHOD") != "GET" or environ.get("PATH_INFO") == "/favicon.ico":
            return general(environ, start_response)
        output = recorded().encode() + generate_latest(others)
        headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            output = gzip.compress(output)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [output]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on stderr."""


def serve_http(app: App, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serves `app` on host:port (IPv4 or IPv6, as the host resolves) from a daemon thread;
    OSError when the port cannot be bound."""
    resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = resolved[0]

    class Server(_ThreadingServer):
        address_family = family

    httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="gengate-metrics", daemon=True)
    thread.start()
    return httpd, thread
