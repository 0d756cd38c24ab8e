"""Shards at fsspec URLs (``s3://``, ``https://``, any scheme fsspec knows): opening, keying, uploading.

Object stores are reached through fsspec and s3fs. Credentials and the endpoint come from the
environment as boto reads them (``AWS_PROFILE`` or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``;
``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for MinIO, Ceph, R2...): nothing here reads, logs or
records them. A failed access is a DataError naming the URL and what to check.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import fsspec

from repsim.errors import DataError

URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
VERSION_FIELDS = ("ETag", "md5Hash", "Content-MD5", "Digest", "checksum", "Last-Modified", "mtime")
STREAMED = {"http": {"block_size": 0}, "https": {"block_size": 0}}  # no range requests: read straight through
ACCESS_FIX = ("check the URL, and for object storage the AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID/"
              "AWS_SECRET_ACCESS_KEY) and endpoint (AWS_ENDPOINT_URL)")


def is_url(location: str | Path) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and bool(URL.match(location))


def join(base: str, name: str) -> str:
    """``name`` inside the folder URL ``base``."""
    return f"{base.rstrip('/')}/{name}"


def beside(location: str | Path, name: str) -> str | Path:
    """The file ``name`` in the folder of the file at ``location`` (a path or a URL)."""
    return join(str(location).rsplit("/", 1)[0], name) if is_url(location) else Path(location).parent / name


@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """Turn a failure to reach ``url`` (missing, forbidden, unreachable) into one DataError line."""
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{url} does not exist", ACCESS_FIX) from None
    except PermissionError as err:
        raise DataError(f"access to {url} is denied ({_first_line(err)})", ACCESS_FIX) from None
    except _storage_errors() as err:
        raise DataError(f"cannot reach {url} ({type(err).__name__}: {_first_line(err)})", ACCESS_FIX) from None


def _storage_errors() -> tuple[type[BaseException], ...]:
    """OSError and the transport errors of the clients fsspec drives."""
    import aiohttp
    import botocore.exceptions

    return OSError, aiohttp.ClientError, botocore.exceptions.BotoCoreError


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def open_stream(url: str) -> IO[bytes]:
    """The object at ``url`` open for reading front to back (a DataError if it cannot be opened)."""
    with reaching(url):
        return fsspec.open(url, "rb", **STREAMED.get(url.split("://", 1)[0].lower(), {})).open()


def remote_file(url: str) -> bool:
    """Whether an object exists at ``url``."""
    fs, path = fsspec.core.url_to_fs(url)
    with reaching(url):
        return fs.isfile(path)


def read_bytes(url: str) -> bytes:
    """The whole object at ``url`` (a small one: a manifest, an index)."""
    with open_stream(url) as stream, reaching(url):
        return stream.read()


def info(url: str) -> tuple[int, str]:
    """(size in bytes, version) of the object at ``url``, the version being its ETag or checksum (or,
    where the store gives neither, its modification time), fetched afresh."""
    fs, path = fsspec.core.url_to_fs(url)
    with reaching(url):
        fs.invalidate_cache(path)
        found = fs.info(path)
    version = next((str(found[field]) for field in VERSION_FIELDS if found.get(field)), None)
    if found.get("type") == "directory" or found.get("size") is None or version is None:
        raise DataError(f"{url} is not an object with a size and an ETag or checksum", "name a file")
    return int(found["size"]), version.strip('"')


def fingerprint(urls: Iterable[str]) -> str:
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
    fs, root = fsspec.core.url_to_fs(url)
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

