"""The stage/cache contract: content-addressed keys, atomic completion, cache hits, no clobbering."""

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from repsim.errors import DiskFull, StageError
from repsim.stage import IN_USE, LOCKED, OutputLock, Stage, read_record, run_stage


@pytest.fixture
def home(repsim_home):
    return repsim_home


def write_answer(value):
    def build(tmp):
        (tmp / "answer.txt").write_text(str(value))
        return {"value": value}
    return build


def test_key_depends_on_every_part_and_nothing_else():
    base = Stage("s", "1", {"a": 1, "b": [1, 2]}, {"up": "k1"})
    assert base.key == Stage("s", "1", {"b": [1, 2], "a": 1}, {"up": "k1"}).key  # order-free
    variants = [Stage("t", "1", base.config, base.inputs), Stage("s", "2", base.config, base.inputs),
                Stage("s", "1", {"a": 2, "b": [1, 2]}, base.inputs), Stage("s", "1", base.config, {"up": "k2"})]
    assert len({base.key, *(v.key for v in variants)}) == 5


def test_completed_stage_is_a_cache_hit_and_is_not_rebuilt(home):
    stage = Stage("s", "1", {"a": 1})
    first = run_stage(stage, write_answer(42))
    assert not first.cached and first.path == home / "artifacts" / "s" / stage.key
    assert (first.path / "answer.txt").read_text() == "42"
    assert read_record(first.path)["metrics"] == {"value": 42}

    def must_not_run(_):
        raise AssertionError("a completed stage was rebuilt")

    second = run_stage(stage, must_not_run)
    assert second.cached and second.path == first.path and second.record == first.record


def test_failed_build_leaves_nothing_that_looks_done(home):
    stage = Stage("s", "1", {"a": 1})

    def fail_halfway(tmp):
        (tmp / "half.txt").write_text("partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_stage(stage, fail_halfway)
    assert not stage.default_dir().exists()
    assert [p.name for p in stage.default_dir().parent.iterdir()] == [f".{stage.key}.lock"]
    assert not run_stage(stage, write_answer(1)).cached


@pytest.mark.parametrize("full", [OSError(errno.ENOSPC, "No space left on device"),
                                  RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0: "
                                               "No space left on device")])  # torch.save rewraps it so
def test_a_full_disk_is_one_line_naming_the_file_system_and_leaves_nothing(home, full):
    stage = Stage("s", "1", {"a": 1})

    def fill_the_disk(tmp):
        (tmp / "half.bin").write_bytes(b"x" * 1000)
        raise full

    message = (r"the file system at /\S* is full: the s stage had written 1,000 bytes into .* when it ran out of "
               r"space, and its partial output is removed \([\d,]+ of [\d,]+ bytes free now\)")
    with pytest.raises(DiskFull, match=message) as raised:
        run_stage(stage, fill_the_disk)
    assert "\n" not in str(raised.value) and "free more than 1,000 bytes there" in str(raised.value)
    assert [p.name for p in stage.default_dir().parent.iterdir()] == [f".{stage.key}.lock"]
    assert not run_stage(stage, write_answer(1)).cached


def test_killed_build_is_cleaned_up_by_the_next_run(home, tmp_path):
    stage = Stage("s", "1", {"a": 1})
    script = textwrap.dedent("""
        import os, time
        from repsim.stage import Stage, run_stage
        def build(tmp):
            (tmp / "half.txt").write_text("partial")
            print("building", flush=True)
            time.sleep(60)
        run_stage(Stage("s", "1", {"a": 1}), build)
    """)
    env = {**os.environ, "REPSIM_HOME": str(home)}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "building"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not stage.default_dir().exists()
    assert any(p.name.startswith(f".{stage.key}.tmp-") for p in stage.default_dir().parent.iterdir())

    output = run_stage(stage, write_answer(7))
    assert not output.cached and (output.path / "answer.txt").read_text() == "7"
    assert not any(".tmp-" in p.name for p in output.path.parent.iterdir())


def test_explicit_output_directory_is_never_clobbered(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(StageError, match="choose another output directory"):
        run_stage(Stage("s", "1", {}), write_answer(1), out_dir=other)
    assert (other / "precious.txt").read_text() == "keep me"

    done = run_stage(Stage("s", "1", {"x": 1}), write_answer(1), out_dir=tmp_path / "out")
    with pytest.raises(StageError, match="holds s output"):
        run_stage(Stage("s", "1", {"x": 2}), write_answer(2), out_dir=done.path)
    assert (done.path / "answer.txt").read_text() == "1"


def test_stage_record_says_what_was_built(home):
    stage = Stage("s", "3", {"a": [1, 2]}, {"source": "abc"})
    record = json.loads((run_stage(stage, write_answer(5)).path / "stage.json").read_text())
    assert record["key"] == stage.key and record["version"] == "3"
    assert record["config"] == {"a": [1, 2]} and record["inputs"] == {"source": "abc"}
    assert record["seconds"] >= 0 and "torch" in record["libraries"]


def test_record_lists_every_output_file_and_a_cache_hit_that_lost_one_is_rebuilt(home):
    builds = []

    def build(tmp):
        builds.append(tmp)
        (tmp / "part").mkdir()
        (tmp / "part" / "rows.txt").write_text("abc")
        (tmp / "answer.txt").write_text("42")

    first = run_stage(Stage("s", "1", {}), build)
    files = read_record(first.path)["files"]
    assert {name: entry["bytes"] for name, entry in files.items()} == {"answer.txt": 2, "part/rows.txt": 3}
    assert files["part/rows.txt"]["sha256"] == hashlib.sha256(b"abc").hexdigest()

    assert run_stage(Stage("s", "1", {}), build).cached and len(builds) == 1
    (first.path / "part" / "rows.txt").unlink()
    again = run_stage(Stage("s", "1", {}), build)
    assert not again.cached and len(builds) == 2 and (again.path / "part" / "rows.txt").read_text() == "abc"


HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from repsim.stage import OutputLock

    with OutputLock(Path(sys.argv[1])).held(shared=sys.argv[2] == "shared", blocking=False) as acquired:
        print(acquired, flush=True)
        sys.stdin.readline()
""")


def holding(out, mode):
    """A process that holds the lock of ``out`` (``shared`` or ``exclusive``) if it can, until killed."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "True", f"another process kept out this {mode} holder"
    return child


def killed(child):
    child.send_signal(signal.SIGKILL)
    child.wait()


def attempt(lock, shared):
    with lock.held(shared=shared, blocking=False) as acquired:
        return acquired


def test_output_lock_is_shared_by_readers_exclusive_to_a_writer_and_freed_when_its_holder_is_killed(tmp_path):
    out = tmp_path / "s" / "key"
    lock = OutputLock(out)
    assert lock.holder() is None and not lock.path.exists()  # the status probe creates nothing
    readers = [holding(out, "shared"), holding(out, "shared")]  # the second reader is not kept out
    assert lock.holder() == IN_USE and attempt(lock, shared=True) and not attempt(lock, shared=False)
    killed(readers[0])
    assert lock.holder() == IN_USE and not attempt(lock, shared=False)
    killed(readers[1])
    assert lock.holder() is None and attempt(lock, shared=False)  # free at once, no stale lock file
    writer = holding(out, "exclusive")
    assert lock.holder() == LOCKED and not attempt(lock, shared=True) and not attempt(lock, shared=False)
    killed(writer)
    assert lock.holder() is None and attempt(lock, shared=True) and lock.path.exists()
