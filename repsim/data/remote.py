"""Shards at fsspec URLs (``s3://``, ``https://``, any scheme fsspec knows): opening, keying, uploading.

Object stores are reached through fsspec and s3fs. Credentials and the endpoint come from the
environment as boto reads them (``AWS_PROFILE`` or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``;
``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for MinIO, Ceph, R2...), resolved once per process;
nothing here reads, logs or records them. A failed access is a DataError naming the URL and what to check.

Timeouts and retries are set here, in :func:`_options`, for every remote read and write: a request waits at
most a sixth of ``$REPSIM_IO_TIMEOUT`` (default 60 s) to connect and for each chunk of its answer, and one
answered 5xx or SlowDown, or cut by a reset, is tried :data:`ATTEMPTS` times in all with backoff (botocore's
standard mode for S3, :func:`_retrying` for HTTP), so a silent server is reported within the timeout. A
streamed read cut short resumes where it stopped, from the same version of the object (:class:`_Resuming`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import io
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.registry import known_implementations

from repsim.errors import DataError, SpecError, first_line

URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
VERSION_FIELDS = ("ETag", "md5Hash", "Content-MD5", "Digest", "checksum", "Last-Modified", "mtime")
BLOCK_SIZES = {"http": 0, "https": 0}  # bytes fetched per request; 0: one request read straight through
S3 = ("s3", "s3a")
HTTP = ("http", "https")  # read-only: fsspec cannot write there
IO_TIMEOUT = "REPSIM_IO_TIMEOUT"  # seconds within which a silent server is reported
ATTEMPTS = 3  # tries of a request answered 5xx or SlowDown or cut by a reset, and of a read cut short
BACKOFF = 0.5  # seconds before the second try, doubling after
FIXES = {  # (scheme family, what failed): what to check
    ("s3", "missing"): "check the bucket and key, and the endpoint (AWS_ENDPOINT_URL) for a store other than AWS",
    ("s3", "denied"): "check the AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY): without "
                      "permission to list the bucket, S3 denies a missing key too",
    ("s3", "unreachable"): "check the endpoint (AWS_ENDPOINT_URL) and the network from this machine",
    ("http", "missing"): "check the URL",
    ("http", "denied"): "check the URL, and that the server lets this machine read it",
    ("http", "unreachable"): "check that the server is up and reachable from this machine",
    (None, "missing"): "check the URL",
    (None, "denied"): "check the URL and the credentials its store reads",
    (None, "unreachable"): "check the URL and the network from this machine",
}


def is_url(location: str | Path) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and bool(URL.match(location))


def scheme(url: str | Path) -> str:
    """The scheme of ``url`` in lower case (``file`` for a local path)."""
    return str(url).split("://", 1)[0].lower() if is_url(url) else "file"


def io_timeout() -> float:
    """``$REPSIM_IO_TIMEOUT`` in seconds (default 60): a silent server is reported within it."""
    value = os.environ.get(IO_TIMEOUT, "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise SpecError(f"{IO_TIMEOUT}={value!r} is not a positive number of seconds", f"unset it or set e.g. {IO_TIMEOUT}=60")
    return seconds


def filesystem(url: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    """(file system, path in it) of ``url`` (or a local path), with :func:`_options`; DataError for a scheme
    fsspec does not know or whose package is not installed. S3 clients share one botocore session per process,
    inherited by forked DataLoader workers: a new session parses botocore's service models again (0.3 s a worker)."""
    protocol = scheme(url)
    try:
        fs, path = fsspec.core.url_to_fs(str(url), **_options(protocol))
    except ImportError as err:
        package = known_implementations[protocol]["class"].split(".")[0]
        raise DataError(f"cannot open {url}: {first_line(err)}",
                        f"pip install {package}" if package != "fsspec" else "install the packages it names") from None
    except ValueError:
        if protocol in fsspec.available_protocols():
            raise
        raise DataError(f"cannot open {url}: fsspec knows no scheme {protocol}://",
                        f"use one of {', '.join(p + '://' for p in fsspec.available_protocols())}") from None
    if protocol in S3:
        fs.retries = 1  # s3fs would try each of botocore's tries again, five times, timeouts included
    return fs, path


def _options(protocol: str) -> dict[str, Any]:
    """The storage options of ``protocol``: the timeouts and retries of its requests (see the module docstring)."""
    wait = io_timeout() / 6  # three tries and botocore's backoff between them (< 3 s) fit in the timeout
    if protocol in S3:
        retries = {"total_max_attempts": ATTEMPTS, "mode": "standard"}
        return {"session": _aws_session(),
                "config_kwargs": {"connect_timeout": wait, "read_timeout": wait, "retries": retries}}
    if protocol in HTTP:
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(connect=wait, sock_read=wait),
                                  "middlewares": (_retrying,)}}
    return {}


@functools.cache
def _aws_session() -> Any:
    import aiobotocore.session

    return aiobotocore.session.AioSession()


async def _retrying(request: Any, handler: Any) -> Any:
    """aiohttp middleware: a request answered 5xx or cut by a reset is sent again, :data:`ATTEMPTS` times in all,
    after a backoff (a refusal, a timeout and an answer under 500 are passed on at once)."""
    for attempt in range(1, ATTEMPTS):
        try:
            response = await handler(request)
            if response.status < 500:
                return response
            response.release()
        except Exception as err:
            if not _broken_off(err):
                raise
        await asyncio.sleep(_backoff(attempt))
    return await handler(request)


def _backoff(attempt: int) -> float:
    """Seconds to wait after failed try number ``attempt``."""
    return BACKOFF * 2 ** (attempt - 1)


class _CutShort(OSError):
    """A body that ended before its size."""


def _broken_off(err: BaseException) -> bool:
    """Whether ``err`` is a connection reset or a body cut short (or failing botocore's checksum): worth another try,
    unlike a refusal or a timeout."""
    import aiohttp
    import botocore.exceptions

    if isinstance(err, aiohttp.ClientConnectorError):  # refused, DNS: a ClientOSError too
        return False
    return isinstance(err, (_CutShort, ConnectionResetError, aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                            aiohttp.ClientOSError, botocore.exceptions.FlexibleChecksumError))


def _unreached(err: BaseException) -> bool:
    """Whether ``err`` says the server was not reached (refused, DNS, no route)."""
    import aiohttp
    import botocore.exceptions

    return isinstance(err, (ConnectionError, aiohttp.ClientConnectionError, botocore.exceptions.ConnectionError))


def join(base: str, name: str) -> str:
    """``name`` inside the folder URL ``base``."""
    return f"{base.rstrip('/')}/{name}"


def beside(location: str | Path, name: str) -> str | Path:
    """The file ``name`` in the folder of the file at ``location`` (a path or a URL)."""
    return join(str(location).rsplit("/", 1)[0], name) if is_url(location) else Path(location).parent / name


# ---------------------------------------------------------------------------------------------
# Failures: what went wrong, in one line, with what to check for the URL's scheme

@contextlib.contextmanager
def reaching(url: str | Path) -> Iterator[None]:
    """Turn a failure to reach the URL ``url`` (missing, denied, unreachable, silent, failing) into one DataError
    line whose fix fits its scheme; a local path's errors pass as they are."""
    if not is_url(url):
        yield
        return
    try:
        yield
    except _storage_errors() as err:
        raise failure(url, err) from None


def _storage_errors() -> tuple[type[BaseException], ...]:
    """OSError, timeouts and the transport errors of the clients fsspec drives."""
    import aiohttp
    import botocore.exceptions

    return OSError, asyncio.TimeoutError, aiohttp.ClientError, botocore.exceptions.BotoCoreError


def failure(url: str | Path, err: BaseException) -> DataError:
    """The one-line DataError of ``err``, raised reaching ``url`` (see :func:`_failed`), its fix fitting the scheme."""
    family = "s3" if scheme(url) in S3 else "http" if scheme(url) in HTTP else None
    innermost = list(_chain(err))[-1]
    cause = first_line(innermost)
    kind = _failed(err)
    if kind == "silent":
        return DataError(f"cannot reach {url}: no answer within {io_timeout():g} s ({cause})",
                         f"{FIXES[family, 'unreachable']}, or raise {IO_TIMEOUT} (seconds) for a slow link")
    if kind == "failing":
        return DataError(f"the server of {url} failed {ATTEMPTS} times ({cause})",
                         "try again later, or ask the store's administrator")
    if kind == "broken":
        return DataError(f"cannot reach {url}: the connection broke off ({cause})",
                         f"{FIXES[family, 'unreachable']}, then try again")
    what = {"denied": f"access to {url} is denied ({cause})", "missing": f"{url} does not exist ({cause})",
            "unreachable": f"cannot reach {url} ({type(innermost).__name__}: {cause})"}[kind]
    return DataError(what, FIXES[family, kind])


def _failed(err: BaseException) -> str:
    """What ``err`` and the errors it came from say: ``silent`` (timed out), ``denied`` (401, 403), ``failing`` (5xx
    after every try), ``broken`` (reset or cut short every try), ``missing`` (404) or ``unreachable`` (refused, DNS)."""
    causes = list(_chain(err))
    status = next((found for found in map(_status, causes) if found), None)
    if any(map(_timed_out, causes)):
        return "silent"
    if status in (401, 403) or isinstance(err, PermissionError):
        return "denied"
    if status is not None and status >= 500:
        return "failing"
    if any(map(_broken_off, causes)):
        return "broken"
    if status == 404 or (isinstance(err, FileNotFoundError) and not any(map(_unreached, causes))):
        return "missing"
    return "unreachable"


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and the errors it came from, outermost first."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _status(err: BaseException) -> int | None:
    """The HTTP status of an answer ``err`` reports (aiohttp's or botocore's), if any."""
    response = getattr(err, "response", None)
    status = getattr(err, "status", None) or (response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _timed_out(err: BaseException) -> bool:
    """Whether ``err`` is a timeout (aiohttp's and fsspec's are asyncio's; botocore's are its own)."""
    import botocore.exceptions

    return isinstance(err, (TimeoutError, asyncio.TimeoutError, botocore.exceptions.ConnectTimeoutError,
                            botocore.exceptions.ReadTimeoutError))


# ---------------------------------------------------------------------------------------------
# Reading

def open_stream(url: str | Path) -> IO[bytes]:
    """The object at ``url`` (a URL or a local path) open for reading front to back; for a URL it resumes after
    a reset or a body cut short (:class:`_Resuming`), and a DataError says why it cannot be opened or read."""
    if not is_url(url):
        return open(url, "rb")
    with reaching(url):
        return io.BufferedReader(_Resuming(str(url)), buffer_size=2**20)


def read_head(url: str | Path, size: int) -> bytes:
    """The first ``size`` bytes of the object at ``url`` (a URL or a local path), fetched without the rest."""
    if not is_url(url):
        with open(url, "rb") as file:
            return file.read(size)
    with reaching(url), io.BufferedReader(_Resuming(str(url), cache_type="none"), buffer_size=size) as stream:
        return stream.read(size)


class _Resuming(io.RawIOBase):
    """The object at ``url``, read front to back. A read that breaks off (a reset, a body cut short) opens the
    object again at the byte it reached, :data:`ATTEMPTS` times in a row at most, after checking that its size
    and version are still those it had: the bytes are those of one clean read, or a DataError."""

    def __init__(self, url: str, **options: Any):
        self.url, self.options, self.offset = url, options, 0  # options: fs.open's
        self.size, self.version = _stat(url) or (None, None)
        self.stream: Any = self._open()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        for attempt in range(1, ATTEMPTS):
            try:
                return self._read_into(buffer)
            except Exception as err:
                if not _broken_off(err):
                    raise
                self._drop()
                time.sleep(_backoff(attempt))
        return self._read_into(buffer)

    def _read_into(self, buffer: Any) -> int:
        self.stream = self.stream or self._reopen()
        count = self.stream.readinto(buffer)
        if not count and self.size is not None and self.offset < self.size:
            raise _CutShort(f"the body ended at byte {self.offset:,} of {self.size:,}")
        self.offset += count
        return count

    def _reopen(self) -> Any:
        """The object open again at ``offset``, once it is known to be the version opened first."""
        if _stat(self.url) != (self.size, self.version):
            raise DataError(f"{self.url} changed while it was read", "read it again once it no longer changes")
        return self._open()

    def _open(self) -> Any:
        """The object open at ``offset``."""
        fs, path = filesystem(self.url)
        stream = fs.open(path, "rb", block_size=BLOCK_SIZES.get(scheme(self.url)), size=self.size, **self.options)
        try:
            stream.seek(self.offset)
        except ValueError:  # a streamed HTTP body: read up to the offset
            while stream.tell() < self.offset and stream.read(min(self.offset - stream.tell(), 2**20)):
                pass
        if stream.tell() != self.offset:
            raise _CutShort(f"the body ended at byte {stream.tell():,}, before byte {self.offset:,} read earlier")
        return stream

    def _drop(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        self.stream = None

    def close(self) -> None:
        self._drop()
        super().close()


def exists(url: str | Path) -> bool:
    """Whether a file exists at ``url`` (a URL or a local path); for a URL, a DataError if that cannot be told."""
    if not is_url(url):
        return Path(url).is_file()
    try:
        return _stat(url) is not None
    except _storage_errors() as err:
        if _failed(err) == "missing":
            return False
        raise failure(url, err) from None


def read_bytes(url: str) -> bytes:
    """The whole object at ``url`` (a small one: a manifest, an index)."""
    with open_stream(url) as stream, reaching(url):
        return stream.read()


def _stat(url: str | Path) -> tuple[int | None, str | None] | None:
    """(size, version) of the object at ``url`` as the store gives them now (see :func:`info`), None for what it
    does not give; None for a folder."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    found = fs.info(path)
    version = next((str(found[field]) for field in VERSION_FIELDS if found.get(field)), None)
    return None if found.get("type") == "directory" else (found.get("size"), version and version.strip('"'))


def info(url: str | Path) -> tuple[int, str]:
    """(size in bytes, version) of the object at ``url``, the version being its ETag or checksum (or,
    where the store gives neither, its modification time), fetched afresh."""
    with reaching(url):
        size, version = _stat(url) or (None, None)
    if size is None or version is None:
        raise DataError(f"{url} is not an object with a size and an ETag or checksum", "name a file")
    return int(size), version


def fingerprint(urls: Iterable[str | Path]) -> str:
    """An input key for objects: a digest of each URL with its size and version (see :func:`info`), so
    that a replaced object gives a new key."""
    digest = hashlib.sha256()
    for url in urls:
        size, version = info(url)
        digest.update(f"{url}\0{size}\0{version}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Uploading

def check_destination(url: str) -> None:
    """DataError, before any work, when the folder URL ``url`` cannot take an upload: a read-only scheme, or a
    store that refuses a small object there (a missing bucket, credentials without write access)."""
    read_only = DataError(f"{url} is read-only: repsim reads {scheme(url)}:// but cannot write there",
                          "upload to object storage (s3://bucket/prefix/) or write to a local folder")
    if scheme(url) in HTTP:
        raise read_only
    fs, root = filesystem(url)
    probe = join(root, f".repsim-probe-{uuid.uuid4().hex}")
    with reaching(url):
        try:
            fs.pipe_file(probe, b"")
        except NotImplementedError:  # a file system fsspec can only read (github://, zip://, ...)
            raise read_only from None
        except FileNotFoundError as err:
            raise DataError(f"cannot write to {url} ({first_line(err)})", "create the bucket first, or correct the URL") from None
        fs.rm_file(probe)


def upload(folder: Path, url: str, last: str) -> list[str]:
    """Upload every file under ``folder`` to the folder URL ``url``, the file named ``last`` after all
    the others (and removed first when anything changes), so that while ``last`` is there the rest is
    complete. Objects whose size and checksum already match are left alone. Returns the names uploaded."""
    fs, root = filesystem(url)
    fs.invalidate_cache(root)  # sizes and ETags as they are now, not as listed earlier in this process
    files = sorted(file.relative_to(folder).as_posix() for file in folder.rglob("*") if file.is_file() and file.name != last)
    with reaching(url):
        changed = [name for name in files if not _same(folder / name, fs, join(root, name))]
        if changed or not _same(folder / last, fs, join(root, last)):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(join(root, last))
            changed.append(last)
        for name in changed:
            fs.put_file(str(folder / name), join(root, name))
    return changed


def _same(file: Path, fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether the object at ``path`` has ``file``'s size and checksum (its ETag, else its bytes' sha256)."""
    try:
        found = fs.info(path)
    except FileNotFoundError:
        return False
    if found.get("size") != file.stat().st_size:
        return False
    if found.get("ETag"):
        return found["ETag"].strip('"') == s3_etag(file)
    with fs.open(path, "rb") as remote, open(file, "rb") as local:
        return hashlib.file_digest(remote, "sha256").digest() == hashlib.file_digest(local, "sha256").digest()


def s3_etag(file: Path) -> str:
    """The ETag of ``file`` uploaded by s3fs: its md5, or for a multipart upload the md5 of the parts'
    md5s and ``-<parts>``."""
    from s3fs.core import calculate_chunksize

    size = file.stat().st_size
    part = calculate_chunksize(size)
    with open(file, "rb") as handle:
        if size < min(5 * 2**30, 2 * part):
            return hashlib.file_digest(handle, "md5").hexdigest()
        parts = [hashlib.md5(chunk).digest() for chunk in iter(lambda: handle.read(part), b"")]
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"
