"""`gengate serve` start-up failures, as a separate process: one error line, exit 2, no traceback."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SCRIPTED = [{"name": "echo", "backend": "scripted"}]


def serve(tmp_path: Path, server: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """Runs `gengate serve --config <file>` with `server` as the config's server section."""
    config = tmp_path / "gengate.yaml"
    config.write_text(yaml.safe_dump({"models": SCRIPTED, "server": {"host": "127.0.0.1", **server}}))
    env = {k: v for k, v in os.environ.items() if k != "GENGATE_UNSET_TOKENS"}
    return subprocess.run(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a failed start (anything else on stderr is the server's INFO log)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("gengate: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(" INFO " in line for line in lines[:-1]), result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed certificate and its key, as PEM files."""
    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    paths = {"cert": folder / "cert.pem", "key": folder / "key.pem"}
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_token_variable_not_set(tmp_path: Path) -> None:
    line = error_line(serve(tmp_path, {"auth_tokens_env": "GENGATE_UNSET_TOKENS"}))
    assert "GENGATE_UNSET_TOKENS" in line and "not set" in line


def test_missing_tls_files(tmp_path: Path) -> None:
    absent = {"tls_cert_file": str(tmp_path / "absent.pem"), "tls_key_file": str(tmp_path / "absent.key")}
    line = error_line(serve(tmp_path, absent))
    assert "tls_cert_file: cannot read" in line and "absent.pem" in line


def test_swapped_tls_files(tmp_path: Path, pem: dict[str, str]) -> None:
    line = error_line(serve(tmp_path, {"tls_cert_file": pem["key"], "tls_key_file": pem["cert"], "port": 0}))
    assert "tls_cert_file" in line and "not a PEM certificate chain and its private key" in line


def test_port_in_use(tmp_path: Path, busy_port: int) -> None:
    line = error_line(serve(tmp_path, {"port": busy_port}))
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line


@pytest.mark.parametrize("host", ["no.such.host.invalid", "999.1.1.1"])
def test_bad_host(tmp_path: Path, host: str) -> None:
    line = error_line(serve(tmp_path, {"port": 0}, "--host", host))
    assert host in line and "does not resolve" in line


def test_message_size_grpc_cannot_take(tmp_path: Path) -> None:
    line = error_line(serve(tmp_path, {"max_message_mb": 100000, "port": 0}))
    assert "max_message_mb" in line


def test_a_good_config_still_serves(tmp_path: Path) -> None:
    """The checks before start refuse nothing grpc would serve: here a free port, then SIGTERM."""
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp_path / "gengate.yaml"
    config.write_text(yaml.safe_dump({"models": SCRIPTED, "server": {"host": "localhost", "port": port}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gengate", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert f"gengate serving on localhost:{port}" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_metrics_port_in_use_is_one_error_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = error_line(serve(tmp_path, {"port": 0}, "--metrics-port", str(port)))
    assert f"cannot serve metrics on 127.0.0.1:{port}" in line


def test_a_bad_metrics_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    line = error_line(serve(tmp_path, {"port": 0}, "--metrics-port", "70000"))
    assert "--metrics-port 70000" in line and "metrics.port" in line


def test_metrics_port_flag_serves_prometheus_text(tmp_path: Path) -> None:
    import re
    import urllib.request

    config = tmp_path / "gengate.yaml"
    config.write_text(yaml.safe_dump({"models": SCRIPTED, "server": {"host": "127.0.0.1"}}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gengate",
            "serve",
            "--config",
            str(config),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert "gengate serving on 127.0.0.1:" in proc.stdout.readline()
        match = re.search(r"gengate metrics on (http://127\.0\.0\.1:\d+/metrics)", proc.stdout.readline())
        assert match is not None
        with urllib.request.urlopen(match.group(1), timeout=10) as response:
            text = response.read().decode()
        assert 'gengate_model_info{backend="scripted",model="echo"} 1.0' in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
