"""Seconds from `specee-cpp chat` to the first character of its first reply, as a new user
meets it: the models already downloaded, nothing of this machine measured yet. With
``--serve``, from `specee-cpp serve` to the first character of a streamed answer to a
request sent as soon as the server listens.

    python scripts/first_reply.py                 # the default pair, 3 fresh starts
    python scripts/first_reply.py --runs 5 --model smollm2-135m
    python scripts/first_reply.py --serve

Each start gets an empty home of its own (``SPECEE_CPP_HOME``) that shares only the
downloaded models, source archive, wheels and tools of the real one, so no cost table, no
kernel choice and no attention timing is cached.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SHARED = ("models", "sdist", "wheels", "tools")


def real_home() -> Path:
    env = os.environ.get("SPECEE_CPP_HOME")
    return Path(env) if env else Path.home() / ".cache" / "specee-cpp"


def fresh_home(root: Path) -> Path:
    home = root / "home"
    home.mkdir(parents=True)
    for name in SHARED:
        src = real_home() / name
        if src.is_dir():
            try:
                (home / name).symlink_to(src, target_is_directory=True)
            except OSError:   # no symlinks (Windows without the right): a copy of the models
                if name == "models":
                    shutil.copytree(src, home / name)
    return home


def first_reply(args: list[str], prompt: str, timeout: float) -> float | None:
    """Seconds until the chat prints a character after its "> " prompt."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SPECEE_CPP_HOME=str(fresh_home(Path(tmp))),
                   PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "chat", *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env)
        p.stdin.write(prompt.encode() + b"\n")
        p.stdin.flush()
        chars: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [chars.put(c) for c in iter(lambda: p.stdout.read(1),
                                                                    b"")] + [chars.put(b"")],
                         daemon=True).start()
        seen, at = b"", None
        while at is None:
            try:
                c = chars.get(timeout=max(timeout - (time.perf_counter() - t0), 0.1))
            except queue.Empty:
                break
            if not c:
                break
            seen += c
            if b"> " in seen and seen.split(b"> ", 1)[1].strip():
                at = time.perf_counter() - t0
        try:
            p.communicate(b"/exit\n", timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
        return at


def first_answer(args: list[str], prompt: str, timeout: float) -> float | None:
    """Seconds until a server started now streams the first character of its answer to a
    request sent as soon as it prints its address."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SPECEE_CPP_HOME=str(fresh_home(Path(tmp))),
                   PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "serve", *args,
                              "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            line = p.stdout.readline().decode()   # "... on http://127.0.0.1:PORT/v1"
            if "http://" not in line:
                return None
            body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                               "max_tokens": 32, "stream": True}).encode()
            req = urllib.request.Request(line.split()[-1] + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                for raw in r:
                    data = raw.decode().strip().removeprefix("data: ")
                    if not raw.startswith(b"data:") or data == "[DONE]":
                        continue
                    choices = json.loads(data).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        return time.perf_counter() - t0
            return None
        finally:
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", help="target (default: the registry's default pair)")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="Write a Python function that adds two numbers.")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--serve", action="store_true",
                    help="time `serve` to its first streamed answer instead of chat")
    a = ap.parse_args()
    args = ([a.model] if a.model else []) + (["--draft", a.draft] if a.draft else [])
    what = "first answer" if a.serve else "first reply"
    times = []
    for i in range(a.runs):
        s = (first_answer(args, a.prompt, a.timeout) if a.serve
             else first_reply(args + ["-n", "32"], a.prompt, a.timeout))
        print(f"start {i + 1}: " + (f"{what} after {s:.1f} s" if s is not None
                                    else f"no {what.split()[1]}"), flush=True)
        if s is not None:
            times.append(s)
    if times:
        print(f"{what} after {min(times):.1f}-{max(times):.1f} s over {len(times)} fresh "
              f"starts")


if __name__ == "__main__":
    main()
