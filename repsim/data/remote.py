"""Shards at fsspec URLs (``s3://``, ``https://``, any scheme fsspec knows): opening, keying, uploading.

Object stores are reached through fsspec and s3fs. Credentials and the endpoint come from the
environment as boto reads them (``AWS_PROFILE`` or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``;
``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for MinIO, Ceph, R2...), resolved once per process;
nothing here reads, logs or records them. A failed access is a DataError naming the URL and what to check.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import fsspec

from repsim.errors import DataError, first_line

URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
VERSION_FIELDS = ("ETag", "md5Hash", "Content-MD5", "Digest", "checksum", "Last-Modified", "mtime")
BLOCK_SIZES = {"http": 0, "https": 0}  # bytes fetched per request; 0: one request read straight through
ACCESS_FIX = ("check the URL, and for object storage the AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID/"
              "AWS_SECRET_ACCESS_KEY) and endpoint (AWS_ENDPOINT_URL)")


def is_url(location: str | Path) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and bool(URL.match(location))


def filesystem(url: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    """(file system, path in it) of ``url`` (or a local path). S3 clients share one botocore session per process,
    inherited by forked DataLoader workers: a new session parses botocore's service models again (0.3 s a worker)."""
    protocol = str(url).split("://", 1)[0].lower()
    return fsspec.core.url_to_fs(str(url), **({"session": _aws_session()} if protocol in ("s3", "s3a") else {}))


@functools.cache
def _aws_session() -> Any:
    import aiobotocore.session

    return aiobotocore.session.AioSession()


def join(base: str, name: str) -> str:
    """``name`` inside the folder URL ``base``."""
    return f"{base.rstrip('/')}/{name}"


def beside(location: str | Path, name: str) -> str | Path:
    """The file ``name`` in the folder of the file at ``location`` (a path or a URL)."""
    return join(str(location).rsplit("/", 1)[0], name) if is_url(location) else Path(location).parent / name


@contextlib.contextmanager
def reaching(url: str | Path) -> Iterator[None]:
    """Turn a failure to reach the URL ``url`` (missing, forbidden, unreachable) into one DataError line;
    a local path's errors pass as they are."""
    if not is_url(url):
        yield
        return
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{url} does not exist", ACCESS_FIX) from None
    except PermissionError as err:
        raise DataError(f"access to {url} is denied ({first_line(err)})", ACCESS_FIX) from None
    except _storage_errors() as err:
        raise DataError(f"cannot reach {url} ({type(err).__name__}: {first_line(err)})", ACCESS_FIX) from None


def _storage_errors() -> tuple[type[BaseException], ...]:
    """OSError and the transport errors of the clients fsspec drives."""
    import aiohttp
    import botocore.exceptions

    return OSError, aiohttp.ClientError, botocore.exceptions.BotoCoreError


def open_stream(url: str | Path) -> IO[bytes]:
    """The object at ``url`` (a URL or a local path) open for reading front to back (for a URL, a DataError if
    it cannot be opened)."""
    fs, path = filesystem(url)
    with reaching(url):
        return fs.open(path, "rb", block_size=BLOCK_SIZES.get(str(url).split("://", 1)[0].lower()))


def exists(url: str | Path) -> bool:
    """Whether a file exists at ``url`` (a URL or a local path)."""
    fs, path = filesystem(url)
    with reaching(url):
        return fs.isfile(path)


def read_bytes(url: str) -> bytes:
    """The whole object at ``url`` (a small one: a manifest, an index)."""
    with open_stream(url) as stream, reaching(url):
        return stream.read()


def info(url: str | Path) -> tuple[int, str]:
    """(size in bytes, version) of the object at ``url``, the version being its ETag or checksum (or,
    where the store gives neither, its modification time), fetched afresh."""
    fs, path = filesystem(url)
    with reaching(url):
        fs.invalidate_cache(path)
        found = fs.info(path)
    version = next((str(found[field]) for field in VERSION_FIELDS if found.get(field)), None)
    if found.get("type") == "directory" or found.get("size") is None or version is None:
        raise DataError(f"{url} is not an object with a size and an ETag or checksum", "name a file")
    return int(found["size"]), version.strip('"')


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

