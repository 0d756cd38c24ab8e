"""Shards in object storage and behind HTTP: moto's S3 server (conftest's ``bucket``) and Python's http.server
on 127.0.0.1; shards uploaded, keyed, streamed, and their failures reported in one line."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import re
import shutil
import socket
import threading
import uuid
from pathlib import Path

import fsspec
import pytest
import requests
import s3fs
import torch
import yaml
from animals import CLASSES, animal_shards
from conftest import AWS_SECRET
from e2e import repsim

from repsim.flows.cli import main
from repsim.data import loader as loader_module
from repsim.data.loader import make_loader
from repsim.data.manifest import MANIFEST
from repsim.data.remote import s3_etag, upload
from repsim.data.stage import ERRORS, INDEX, ShardResult, shard, shard_stage
from repsim.data.spec import load_spec
from repsim.errors import DataError, RepsimError
from repsim.eval.stage import evaluate
from repsim.methods.config import Config
from repsim.methods.stage import train, train_stage_of
from repsim.models import load_encoder
from repsim.stage import artifacts_root


@pytest.fixture
def forbidden(moto_endpoint):
    """Within the test, moto checks credentials, and refuses the test's keys (which no IAM user holds)."""
    requests.post(f"{moto_endpoint}/moto-api/reset-auth", data=b"0").raise_for_status()
    yield
    requests.post(f"{moto_endpoint}/moto-api/reset-auth", data=b"inf").raise_for_status()


@pytest.fixture(scope="module")
def animals(tmp_path_factory) -> tuple[Path, ShardResult]:
    return animal_shards(tmp_path_factory.mktemp("animals"), shard_size=32)  # train: 4 tars of 32, test: 1 of 32


@pytest.fixture
def uploaded(animals, bucket, tmp_path) -> tuple[str, Path]:
    """(prefix URL, data spec naming the shards there) of the animals' shards uploaded to ``bucket``."""
    _, shards = animals
    prefix = f"s3://{bucket}/animals/"
    upload(shards.path, prefix, last=MANIFEST)
    return prefix, in_place_spec(tmp_path, prefix)


def in_place_spec(folder: Path, prefix: str, name: str = "remote.yaml") -> Path:
    """A data spec of the animals' shards read in place at the folder URL ``prefix``."""
    spec = folder / name
    spec.write_text(yaml.safe_dump({
        "name": "animals", "classes": CLASSES,
        "source": {"type": "webdataset", "urls": f"{prefix}{{train-{{00000..00003}},test-00000}}.tar",
                   "manifest": f"{prefix}{MANIFEST}"}}))
    return spec


def tiny_config(spec: Path) -> Config:
    """One epoch of SupCon on resnet18 at 28 px: 4 steps of 32."""
    return Config.model_validate({
        "method": {"name": "supcon"}, "data": {"spec": str(spec), "image_size": 28},
        "model": {"small_images": False, "projection_hidden_dim": 64, "projection_dim": 32},
        "optim": {"batch_size": 32, "epochs": 1, "warmup_epochs": 0, "num_workers": 0}, "monitor": {"knn": False}})


def s3() -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True)


def one_error_line(capsys) -> str:
    """The CLI's error line; before it, stderr holds at most a progress bar, never a traceback or the secret key."""
    err = capsys.readouterr().err
    *before, line = err.rstrip("\n").split("\n")
    assert line.startswith("error: ") and "Traceback" not in err and not any("error" in text for text in before), err
    assert AWS_SECRET not in err
    return line


# ---------------------------------------------------------------------------------------------
# Uploading

def test_upload_sends_the_manifest_last_and_again_sends_nothing(animals, bucket):
    _, shards = animals
    prefix = f"s3://{bucket}/animals/"
    sent = upload(shards.path, prefix, last=MANIFEST)
    assert sent[-1] == MANIFEST and "stage.json" in sent and "train-00003.tar" in sent
    assert sorted(sent) == sorted(file.name for file in shards.path.iterdir())
    assert upload(shards.path, prefix, last=MANIFEST) == []
    fs = s3()
    assert fs.cat(f"{prefix}train-00001.tar") == (shards.path / "train-00001.tar").read_bytes()
    fs.pipe(f"{prefix}train-00001.tar", b"replaced")
    assert upload(shards.path, prefix, last=MANIFEST) == ["train-00001.tar", MANIFEST]


def test_an_upload_cut_short_leaves_no_manifest_vouching_for_the_objects(animals, bucket, monkeypatch):
    _, shards = animals
    prefix = f"s3://{bucket}/animals/"
    upload(shards.path, prefix, last=MANIFEST)
    s3().pipe(f"{prefix}test-00000.tar", b"stale")  # so the next upload has something to send

    async def lost(*args, **kwargs):
        raise ConnectionResetError("connection lost")

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", lost)
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(DataError, match="cannot reach .*connection lost"):
        upload(shards.path, prefix, last=MANIFEST)
    assert not s3().exists(f"{prefix}{MANIFEST}")


def test_an_upload_to_a_store_without_etags_compares_contents(animals):
    _, shards = animals
    prefix = f"memory://copies-{uuid.uuid4().hex[:8]}/animals/"
    assert len(upload(shards.path, prefix, last=MANIFEST)) == len(list(shards.path.iterdir()))
    assert upload(shards.path, prefix, last=MANIFEST) == []
    memory = fsspec.filesystem("memory")
    memory.pipe(f"{prefix}train-00000.tar", memory.cat(f"{prefix}train-00000.tar")[::-1])  # same size
    assert upload(shards.path, prefix, last=MANIFEST) == ["train-00000.tar", MANIFEST]


def test_the_etag_of_a_multipart_upload_is_computed_as_s3_computes_it(tmp_path, bucket):
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (105 * 2**20 // 256))  # 105 MiB: three parts of 50 MiB
    upload(tmp_path, f"s3://{bucket}/big/", last="big.bin")
    etag = s3().info(f"s3://{bucket}/big/big.bin")["ETag"].strip('"')
    assert etag.endswith("-3") and etag == s3_etag(big)


# ---------------------------------------------------------------------------------------------
# Reading in place

def test_shards_in_a_bucket_are_read_in_place_and_keyed_by_their_etags(animals, uploaded):
    _, shards = animals
    prefix, spec = uploaded
    found = shard(spec, progress=False)
    assert not list(found.path.glob("*.tar"))  # nothing copied: the output lists the tars by URL
    assert found.shards == {"train": [f"{prefix}train-0000{n}.tar" for n in range(4)], "test": [f"{prefix}test-00000.tar"]}
    assert found.splits == shards.splits and found.image_format == shards.image_format
    assert (found.path / MANIFEST).read_bytes() == shards.manifest.read_bytes()
    for workers in (0, 2):  # forked workers open the bucket themselves
        batches = [make_loader(where, "simclr", 16, num_workers=workers) for where in (shards.path, found.path)]
        for local, remote in zip(*batches, strict=True):
            assert torch.equal(local["views"][1], remote["views"][1]) and torch.equal(local["index"], remote["index"])
    assert shard(spec, progress=False).cached


def test_local_shards_named_with_their_manifest_are_read_in_place(animals, tmp_path):
    _, shards = animals
    found = shard(in_place_spec(tmp_path, f"{shards.path}/"), progress=False)
    assert found.shards["test"] == [shards.path / "test-00000.tar"] and not list(found.path.glob("*.tar"))
    local, in_place = (make_loader(where, "eval", 32, split="test") for where in (shards.path, found.path))
    assert all(torch.equal(a["views"][0], b["views"][0]) for a, b in zip(local, in_place, strict=True))


def test_a_loader_finds_the_manifest_beside_tar_urls(animals, uploaded):
    _, shards = animals
    prefix, _ = uploaded
    loader = make_loader(f"{prefix}train-{{00000..00003}}.tar", "eval", 32, shuffle=False)
    local = make_loader(shards.path, "eval", 32, shuffle=False)
    assert len(loader) == len(local) == 4  # counted from the manifest, read through fsspec
    assert all(torch.equal(a["index"], b["index"]) for a, b in zip(loader, local, strict=True))


def test_shards_behind_http_are_read_in_place(animals, tmp_path):
    _, shards = animals
    handler = functools.partial(Quiet, directory=str(shards.path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        spec = in_place_spec(tmp_path, f"http://127.0.0.1:{server.server_address[1]}/")
        found = shard(spec, progress=False)
        remote = [batch["views"][0] for batch in make_loader(found.path, "eval", 32, split="train")]
        server.shutdown()
    local = [batch["views"][0] for batch in make_loader(shards.path, "eval", 32, split="train")]
    assert len(remote) == 4 and all(torch.equal(a, b) for a, b in zip(local, remote, strict=True))


def untimed(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{name: value for name, value in each.items() if not name.startswith("seconds")} for each in metrics]


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
def test_training_and_evaluating_from_the_bucket_alone_equals_the_local_run(bucket, tmp_path):
    spec, shards = animal_shards(tmp_path / "own", shard_size=32)
    upload(shards.path, f"s3://{bucket}/animals/", last=MANIFEST)
    remote_spec = in_place_spec(tmp_path, f"s3://{bucket}/animals/")
    runs = {}
    for name, data in (("local", spec), ("bucket", remote_spec)):
        if name == "bucket":
            shutil.rmtree(shards.path.parent / "images")
            shutil.rmtree(shards.path)  # the local copy is gone: only the bucket holds the shards
        output = train(tiny_config(data), device="cpu", progress=False)
        evaluated = evaluate(shard(data, progress=False), output.path, ["knn"], [5], device="cpu", progress=False)
        runs[name] = load_encoder(output.path).state_dict(), evaluated.metrics, output.metrics
    (local_weights, *local_metrics), (bucket_weights, *bucket_metrics) = runs["local"], runs["bucket"]
    assert local_weights.keys() == bucket_weights.keys()
    assert all(torch.equal(local_weights[key], bucket_weights[key]) for key in local_weights)
    assert untimed(local_metrics) == untimed(bucket_metrics) and "knn_top1_k5" in local_metrics[0]
    for record in artifacts_root().rglob("stage.json"):
        assert AWS_SECRET not in record.read_text()


# ---------------------------------------------------------------------------------------------
# Failures: one line, exit 2, nothing that looks complete

def test_a_replaced_object_is_a_new_key_for_the_shards_and_the_training(uploaded, bucket):
    prefix, spec = uploaded
    keys = shard_stage(load_spec(spec)).key, train_stage_of(tiny_config(spec), shard(spec, progress=False)).key
    fs = s3()
    fs.pipe(f"{prefix}train-00002.tar", fs.cat(f"{prefix}train-00002.tar") + b"\0" * 512)
    assert shard_stage(load_spec(spec)).key != keys[0]
    assert train_stage_of(tiny_config(spec), shard(spec, progress=False)).key != keys[1]


def test_a_missing_bucket_is_one_line(animals, bucket, tmp_path, capsys):
    spec = in_place_spec(tmp_path, "s3://no-such-bucket-4a1f/animals/")
    assert main(["shard", str(spec)]) == 2
    assert "s3://no-such-bucket-4a1f/animals/manifest.parquet does not exist" in one_error_line(capsys)
    with pytest.raises(DataError, match="no-such-bucket-4a1f"):
        upload(animals[1].path, "s3://no-such-bucket-4a1f/animals/", last=MANIFEST)


@pytest.mark.slow
@pytest.mark.orchestration
def test_the_shard_command_uploads_to_a_bucket_and_refuses_a_missing_one(animals, bucket, tmp_path):
    spec, shards = animals
    home, prefix = tmp_path / "home", f"s3://{bucket}/animals/"
    for uploaded in (len(list(shards.path.iterdir())), 0):
        done = repsim(home, "shard", str(spec), "--out", prefix)  # the bucket's settings pass on in the environment
        assert done.returncode == 0, done.stderr
        assert f"{prefix} {uploaded} files uploaded" in done.stdout
    assert s3().cat(f"{prefix}{MANIFEST}") == shards.manifest.read_bytes()
    refused = repsim(home, "shard", str(spec), "--out", "s3://no-such-bucket-4a1f/animals/")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert "no-such-bucket-4a1f" in line
    assert not any(AWS_SECRET.encode() in file.read_bytes() for file in home.rglob("*") if file.is_file())


def test_wrong_credentials_are_one_line_and_never_shown(uploaded, forbidden, capsys):
    _, spec = uploaded
    s3fs.S3FileSystem.clear_instance_cache()
    assert main(["shard", str(spec)]) == 2
    assert "access to s3://" in one_error_line(capsys)


def test_an_object_missing_mid_epoch_fails_training_in_one_line_and_leaves_no_output(uploaded, bucket, tmp_path,
                                                                                      monkeypatch, capsys):
    prefix, spec = uploaded
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(spec).model_dump(mode="json")))
    key = train_stage_of(tiny_config(spec), shard(spec, progress=False)).key
    read = loader_module.read_samples

    def deleting_the_rest(url: str, expected: int | None = None):
        yield from read(url, expected)
        s3().rm([path for path in s3().glob(f"{prefix}train-*.tar")])  # gone after the first tar

    monkeypatch.setattr(loader_module, "read_samples", deleting_the_rest)
    assert main(["train", str(config), "--direct"]) == 2
    assert "does not exist" in one_error_line(capsys)
    assert not (artifacts_root() / "train" / key).exists()


def test_a_truncated_object_fails_by_name_and_leaves_no_output(uploaded, bucket, tmp_path, capsys):
    prefix, spec = uploaded
    fs = s3()
    fs.pipe(f"{prefix}train-00001.tar", fs.cat(f"{prefix}train-00001.tar")[:20_000])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(spec).model_dump(mode="json")))
    key = train_stage_of(tiny_config(spec), shard(spec, progress=False)).key
    assert main(["train", str(config), "--direct"]) == 2
    assert f"{prefix}train-00001.tar" in one_error_line(capsys)
    assert not (artifacts_root() / "train" / key).exists()


def test_an_incomplete_upload_is_refused_as_incomplete(animals, bucket, tmp_path, capsys):
    _, shards = animals
    prefix = f"s3://{bucket}/partial/"
    for name in ("train-00000.tar", INDEX, ERRORS):  # what an upload cut short before its manifest leaves
        s3().put_file(str(shards.path / name), f"{prefix}{name}")
    assert main(["shard", str(in_place_spec(tmp_path, prefix))]) == 2
    assert f"{prefix}{MANIFEST} does not exist" in one_error_line(capsys)


def test_an_experiment_shard_section_refuses_a_bucket_and_names_the_command(tmp_path, capsys):
    experiment = tmp_path / "upload.yaml"
    experiment.write_text(yaml.safe_dump({"name": "upload", "data": "animal-mnist",
                                          "stages": [{"kind": "shard", "out": "s3://bucket/prefix/"}]}))
    assert main(["run", str(experiment)]) == 2
    assert "repsim shard SPEC --out URL" in one_error_line(capsys)


# ---------------------------------------------------------------------------------------------
# What failed, in one line whose fix fits the scheme; refused before any work

class Forbidding(Quiet):
    """Refuses every file: 403."""

    def send_head(self):
        self.send_error(403)


@pytest.mark.parametrize(("handler", "said"), [(Quiet, "does not exist"), (Forbidding, "is denied")])
def test_a_missing_or_forbidden_http_object_is_one_line_without_aws(tmp_path, capsys, handler, said):
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(tmp_path))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        spec = in_place_spec(tmp_path, f"http://127.0.0.1:{server.server_address[1]}/")
        assert main(["shard", str(spec)]) == 2
        server.shutdown()
    line = one_error_line(capsys)
    assert f"{MANIFEST} {said}" in line and "AWS" not in line


def test_a_refused_http_connection_is_one_line_without_aws(tmp_path, capsys):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once it is closed
    assert main(["shard", str(in_place_spec(tmp_path, f"http://127.0.0.1:{port}/"))]) == 2
    line = one_error_line(capsys)
    assert f"cannot reach http://127.0.0.1:{port}/{MANIFEST} (ConnectionRefusedError" in line
    assert "does not exist" not in line and "AWS" not in line


@pytest.mark.parametrize(("scheme", "said"), [("foo", ["fsspec knows no scheme foo://; use one of ", "s3://", "https://"]),
                                               ("gs", ["Please install gcsfs to access Google Storage; pip install gcsfs"])])
def test_a_scheme_fsspec_cannot_open_is_one_line_naming_the_fix(tmp_path, capsys, scheme, said):
    if scheme == "gs" and importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed")
    assert main(["shard", str(in_place_spec(tmp_path, f"{scheme}://bucket/animals/"))]) == 2
    line = one_error_line(capsys)
    assert all(text in line for text in said)


@pytest.mark.parametrize(("out", "said"), [("http://127.0.0.1:9/animals/", "is read-only"),
                                           ("s3://no-such-bucket-4a1f/animals/", "create the bucket first")])
def test_an_upload_destination_that_cannot_take_it_is_refused_before_any_work(animals, bucket, capsys, out, said):
    spec, _ = animals
    assert main(["shard", str(spec), "--out", out]) == 2
    line = one_error_line(capsys)
    assert out in line and said in line
    assert not artifacts_root().exists()  # nothing sharded


@pytest.mark.parametrize("where", ["bucket", "local"])
def test_a_tar_swapped_for_another_shards_tar_is_named(animals, bucket, tmp_path, where):
    spec, shards = animals
    if where == "bucket":
        prefix = f"s3://{bucket}/animals/"
        upload(shards.path, prefix, last=MANIFEST)
        s3().pipe(f"{prefix}train-00001.tar", s3().cat(f"{prefix}train-00002.tar"))
        swapped, sharding = f"{prefix}train-00001.tar", lambda: shard(in_place_spec(tmp_path, prefix), progress=False)
    else:
        copy = shutil.copytree(shards.path, tmp_path / "shards")
        shutil.copyfile(copy / "train-00002.tar", copy / "train-00001.tar")  # the same size: still a cache hit
        swapped, sharding = copy / "train-00001.tar", lambda: shard(spec, out_dir=copy, progress=False)
    with pytest.raises(RepsimError, match=re.escape(str(swapped)) + r" starts with sample \d+ where the manifest lists \d+"):
        evaluate(sharding(), suites=["knn"], knn_k=[5], device="cpu", progress=False)
