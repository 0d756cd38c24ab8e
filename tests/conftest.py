"""Shared fixtures: an isolated artifact root per test, tiny synthetic datasets, and an S3 bucket on moto's server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

AWS_SECRET = "not-a-real-secret-key-5e3c"  # the bucket fixture's secret key: no output may hold it


STORES = ("PREFECT_HOME", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")  # where Prefect and MLflow keep their records


@pytest.fixture(autouse=True)
def repsim_home(tmp_path, monkeypatch) -> Iterator[Path]:
    """Every test gets its own ``$REPSIM_HOME``, so no test reads another's cache, and no store of the shell's or
    of an earlier test's: what a command run in the test process sets for good (``use_embedded_defaults``) goes
    with the test."""
    home = tmp_path / "repsim-home"
    monkeypatch.setenv("REPSIM_HOME", str(home))
    for name in STORES:
        monkeypatch.delenv(name, raising=False)
    before = set(os.environ)
    yield home
    for name in set(os.environ) - before:
        del os.environ[name]


def synthetic_pixels(seed: int, size: int = 8, mode: str = "L") -> np.ndarray:
    """Deterministic uint8 pixels (size, size) for "L" or (size, size, 3) for "RGB"."""
    shape = (size, size) if mode == "L" else (size, size, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture
def make_image_folder(tmp_path):
    """``make(counts, splits=None, mode="L", size=8)``: PNGs in ``[<split>/]<class>/<class>-<i>.png``.

    ``counts`` maps class name -> images per class (per split when ``splits`` is given). Returns the
    root; image ``k`` (in creation order) has the pixels ``synthetic_pixels(k, size, mode)``.
    """
    def make(counts: dict[str, int], splits: tuple[str, ...] | None = None, mode: str = "L",
             size: int = 8, name: str = "images") -> Path:
        root = tmp_path / name
        seed = 0
        for split in splits or (None,):
            for class_name, count in counts.items():
                folder = root / split / class_name if split else root / class_name
                folder.mkdir(parents=True)
                for i in range(count):
                    Image.fromarray(synthetic_pixels(seed, size, mode)).save(folder / f"{class_name}-{i}.png")
                    seed += 1
        return root
    return make


@pytest.fixture
def write_spec(tmp_path):
    """``write(spec_dict, name="spec.yaml")``: the path of a YAML data spec written into tmp_path."""
    def write(spec: dict, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path
    return write


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (small matrices run faster without thread start-up)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    """The URL of moto's S3 server, started on 127.0.0.1 for the session."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(moto_endpoint, monkeypatch) -> str:
    """A new, empty bucket; the AWS variables point boto at the moto server (the endpoint by AWS_ENDPOINT_URL)."""
    import uuid

    import s3fs

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    name = f"shards-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(name)
    return name
