"""`radixserve bench serve` against a server it cannot use: one error line and exit 2, no traceback."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from radixserve.cli import main

KEY = "s3cret"


class _KeyedModels(BaseHTTPRequestHandler):
    """/v1/models behind an API key, answering as RadixServe's guard does."""

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            status, body = 200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        else:
            status = 401
            body = {"error": {"message": "invalid or missing API key", "type": "authentication_error",
                              "param": None, "code": None}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - the load itself is not under test: fail it fast
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def keyed_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedModels)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_missing_api_key_is_one_error_line(keyed_server, capsys, monkeypatch):
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    assert main(["bench", "serve", "--base-url", keyed_server, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "radixserve bench serve: error: GET /v1/models answered 401: invalid or missing API key "
        "(pass --api-key, or set $RADIXSERVE_API_KEY)"
    ]


def test_api_key_from_the_environment(keyed_server, capsys, monkeypatch):
    """$RADIXSERVE_API_KEY is used without --api-key: the model listing succeeds and the load runs
    (its requests fail here, by design of the fake server: exit 1, not the start-up error)."""
    monkeypatch.setenv("RADIXSERVE_API_KEY", KEY)
    assert main(["bench", "serve", "--base-url", keyed_server, "--num-prompts", "1", "--output-len", "2",
                 "--input-len", "2"]) == 1
    out = capsys.readouterr()
    assert "error:" not in out.err
    assert json.loads(out.out)["failed"] == 1


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("model", [[], ["--model", "tiny"]])
def test_unreachable_server_is_one_error_line(model, capsys, monkeypatch):
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{_unused_port()}"
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1", *model]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"radixserve bench serve: error: cannot reach {url}: "), out.err
    assert "Traceback" not in out.err and out.out == ""
