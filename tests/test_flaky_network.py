"""A bad day on the network: a proxy on 127.0.0.1, in front of moto's S3 server or Python's http.server, that
never answers, answers 503, resets a connection mid-body or cuts a body short. Flaky answers are retried to the
bytes and keys of a clean run; a silent server is one line within REPSIM_IO_TIMEOUT; nothing failed looks done."""

from __future__ import annotations

import functools
import http.client
import http.server
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.retries.standard
import pytest
import s3fs
import torch
from animals import animal_shards
from test_remote import Quiet, in_place_spec, one_error_line

from repsim.flows.cli import main
from repsim.data import remote
from repsim.data.loader import make_loader
from repsim.data.manifest import MANIFEST
from repsim.data.stage import ShardResult, shard, shard_stage
from repsim.data.spec import load_spec
from repsim.errors import DataError
from repsim.stage import STAGE_FILE, artifacts_root

TIMEOUT = 6  # REPSIM_IO_TIMEOUT in these tests, seconds
SLACK = 2  # seconds a loaded machine may add to it
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect"}


class FlakyProxy(http.server.ThreadingHTTPServer):
    """A proxy on 127.0.0.1 in front of the HTTP server at ``upstream`` (host, port) that spoils every ``every``-th
    request it can, from the first: ``silent`` never answers any request; ``503`` answers 503 without passing it
    on; ``reset`` and ``truncate`` pass it on, then send half of an answer's body and reset (RST) or close the
    connection; ``short`` sends half the body as if it were all of it. ``mode`` None passes everything on; it may
    change while the proxy runs. ``on_fault`` runs before each answer cut short; ``faults`` counts the spoiled
    requests."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], mode: str | None, every: int = 3):
        super().__init__(("127.0.0.1", 0), _Forwarding)
        self.upstream, self.mode, self.every = upstream, mode, every
        self.on_fault: Callable[[], None] = lambda: None
        self.faults, self._spoilable, self._lock, self.stopping = 0, itertools.count(), threading.Lock(), threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FlakyProxy:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()  # silent handlers return
        self.shutdown()
        self.server_close()

    def spoils(self, mode: str) -> bool:
        """Whether this request, one ``mode`` can spoil, is one of every ``every``-th."""
        with self._lock:
            spoiled = self.mode == mode and next(self._spoilable) % self.every == 0
            self.faults += spoiled
            return spoiled


class _Forwarding(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FlakyProxy

    def log_message(self, *args: object) -> None:
        pass

    def forward(self) -> None:
        proxy = self.server
        if proxy.mode == "silent":
            proxy.stopping.wait()
            self.close_connection = True
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if proxy.spoils("503"):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, reason, headers, answer = self.upstream_answer(body)
        if answer and proxy.spoils("short"):
            answer = answer[:len(answer) // 2]
            headers = [(name, str(len(answer)) if name.lower() == "content-length" else value) for name, value in headers]
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if answer and (proxy.spoils("reset") or proxy.spoils("truncate")):
            proxy.on_fault()
            self.wfile.write(answer[:len(answer) // 2])
            self.wfile.flush()
            if proxy.mode == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        self.wfile.write(answer)

    def upstream_answer(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """(status, reason, headers, body) of the upstream server's answer to this request."""
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        try:
            headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP}
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        finally:
            connection.close()
        kept = [(name, value) for name, value in response.getheaders() if name.lower() not in HOP_BY_HOP]
        if self.command != "HEAD" and not any(name.lower() == "content-length" for name, _ in kept):
            kept.append(("Content-Length", str(len(answer))))
        return response.status, response.reason, kept, answer

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward


# ---------------------------------------------------------------------------------------------
# Fixtures: the shards, served by S3 or HTTP behind a proxy

@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardResult:
    return animal_shards(tmp_path_factory.mktemp("animals"), shard_size=32)[1]  # train: 4 tars of 32, test: 1 of 32


@pytest.fixture
def io_timeout(monkeypatch) -> None:
    monkeypatch.setenv(remote.IO_TIMEOUT, str(TIMEOUT))


@pytest.fixture
def quick_retries(monkeypatch) -> None:
    """Tries of a request or a read 10 ms apart (repsim's backoff and botocore's), to keep flaky runs short."""
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0.01)


@pytest.fixture(params=["s3", "http"])
def served(request, shards, tmp_path, monkeypatch, io_timeout) -> Iterator[tuple[str, FlakyProxy, Path]]:
    """(scheme, proxy, data spec of the shards read through it): the shards uploaded to a bucket whose endpoint is the
    proxy, or served by http.server behind it. The proxy starts clean."""
    if request.param == "s3":
        bucket = request.getfixturevalue("bucket")
        remote.upload(shards.path, f"s3://{bucket}/animals/", last=MANIFEST)
        with FlakyProxy(_host_port(request.getfixturevalue("moto_endpoint")), None) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            s3fs.S3FileSystem.clear_instance_cache()
            yield "s3", proxy, in_place_spec(tmp_path, f"s3://{bucket}/animals/")
        return
    handler = functools.partial(Quiet, directory=str(shards.path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with FlakyProxy(server.server_address, None) as proxy:
            yield "http", proxy, in_place_spec(tmp_path, f"{proxy.url}/")
        server.shutdown()


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def no_output() -> bool:
    """Whether no stage output under $REPSIM_HOME looks complete: no completion record (stage.json), no manifest."""
    return not [*artifacts_root().rglob(STAGE_FILE), *artifacts_root().rglob(MANIFEST)]


# ---------------------------------------------------------------------------------------------
# Flaky answers: retried, to the bytes and keys of a clean run

@pytest.mark.parametrize("mode", ["503", "reset", "truncate", "short"])
def test_flaky_answers_are_retried_to_the_bytes_and_key_of_a_clean_run(served, shards, quick_retries, mode):
    _, proxy, spec = served
    clean_key = shard_stage(load_spec(spec)).key
    proxy.mode = mode
    found = shard(spec, progress=False)
    assert found.key == clean_key
    assert (found.path / MANIFEST).read_bytes() == shards.manifest.read_bytes()
    for tar in found.shards["train"]:
        assert remote.read_bytes(tar) == (shards.path / tar.rsplit("/", 1)[-1]).read_bytes()
    local, through = (make_loader(where, "eval", 32, split="train") for where in (shards.path, found.path))
    assert all(torch.equal(a["views"][0], b["views"][0]) for a, b in zip(local, through, strict=True))
    assert proxy.faults >= 3


@pytest.mark.parametrize("mode", ["503", "reset", "truncate"])
def test_an_upload_through_flaky_answers_sends_the_same_bytes(shards, bucket, moto_endpoint, quick_retries, monkeypatch,
                                                              mode):
    with FlakyProxy(_host_port(moto_endpoint), mode) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3fs.S3FileSystem.clear_instance_cache()
        sent = remote.upload(shards.path, f"s3://{bucket}/animals/", last=MANIFEST)
        stored = s3fs.S3FileSystem(endpoint_url=moto_endpoint, skip_instance_cache=True)
        assert sent[-1] == MANIFEST and proxy.faults >= 1
    for file in shards.path.iterdir():
        assert stored.cat(f"{bucket}/animals/{file.name}") == file.read_bytes()


def test_an_object_replaced_before_a_read_resumes_is_refused(bucket, moto_endpoint, quick_retries, monkeypatch):
    url = f"s3://{bucket}/object.bin"
    stored = s3fs.S3FileSystem(endpoint_url=moto_endpoint, skip_instance_cache=True)
    stored.pipe(url, bytes(range(256)) * 4096)
    with FlakyProxy(_host_port(moto_endpoint), "reset") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.on_fault = lambda: stored.pipe(url, bytes(reversed(range(256))) * 4096)  # same size, new ETag
        with pytest.raises(DataError, match=f"{url} changed while it was read"):
            remote.read_bytes(url)
        assert proxy.faults == 1


# ---------------------------------------------------------------------------------------------
# Failures: one line within the timeout, nothing that looks done

def test_a_silent_server_is_one_line_within_the_timeout(served, capsys):
    scheme, proxy, spec = served
    proxy.mode = "silent"
    started = time.monotonic()
    assert main(["shard", str(spec)]) == 2
    assert time.monotonic() - started < TIMEOUT + SLACK
    line = one_error_line(capsys)
    assert f"no answer within {TIMEOUT} s" in line and "does not exist" not in line
    assert ("AWS_ENDPOINT_URL" in line) == (scheme == "s3") and ("AWS" in line) == (scheme == "s3")
    assert no_output()


def test_a_server_falling_silent_mid_stage_leaves_no_output(served):
    _, proxy, spec = served
    data = load_spec(spec)
    proxy.mode = "silent"
    started = time.monotonic()
    with pytest.raises(DataError, match=f"no answer within {TIMEOUT} s"):
        shard(data, progress=False)
    assert time.monotonic() - started < TIMEOUT + SLACK and no_output()


@pytest.mark.parametrize(("mode", "said"), [("503", "failed 3 times"), ("reset", "broke off")])
def test_a_server_failing_every_try_is_one_line_and_leaves_no_output(served, quick_retries, mode, said):
    _, proxy, spec = served
    proxy.mode, proxy.every = mode, 1
    with pytest.raises(DataError, match=said):
        shard(spec, progress=False)
    assert no_output()


def test_a_timeout_that_is_not_a_number_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(remote.IO_TIMEOUT, "soon")
    assert main(["shard", str(in_place_spec(tmp_path, "http://127.0.0.1:9/"))]) == 2
    assert "REPSIM_IO_TIMEOUT='soon' is not a positive number of seconds" in one_error_line(capsys)
