"""Weights on huge pages (memory.py, patches/0008): the policy read from sysfs, the
choice between mapping the file and a private copy, and on a real model that the patched
ggml's buffers do land on 2 MiB pages and that the output does not depend on where they are."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specee_cpp import memory

# our plain loop in a fresh process: page settings are per process (the patched ggml reads
# SPECEE_CPP_HUGEPAGES when it allocates, llama.cpp maps or reads the weights at load)
CHILD = r"""
import json, sys
from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.memory import anon_huge_bytes
model, mmap = sys.argv[1], sys.argv[2] == "1"
with LLM(model, config=LoadConfig(mmap=mmap, n_ctx=512)) as llm:
    r = llm.generate(sys.stdin.read(), chat=False, max_tokens=16, mode="plain")
    held = anon_huge_bytes()
print(json.dumps({"tokens": r.tokens, "huge": held, "after": anon_huge_bytes()}))
"""


def child_run(model: str, mmap: bool, huge_pages: bool) -> dict:
    env = dict(os.environ, SPECEE_CPP_HUGEPAGES="1" if huge_pages else "0")
    r = subprocess.run([sys.executable, "-c", CHILD, model, "1" if mmap else "0"],
                       input="The capital of France is", capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_thp_mode_reads_the_bracketed_policy(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert memory.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert memory.thp_mode(f) == "always"
    assert memory.thp_mode(tmp_path / "missing") is None


def test_mem_available(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable:  2048 kB\n")
    assert memory.mem_available(f) == 2048 * 1024
    f.write_text("MemTotal: 1000 kB\n")
    assert memory.mem_available(f) is None


def test_private_weights_only_where_huge_pages_help_and_it_fits(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1000)
    monkeypatch.delenv("SPECEE_CPP_HUGEPAGES", raising=False)
    assert memory.private_weights(model, 0, thp="madvise", available=2000)
    assert memory.private_weights(model, 0, thp="always", available=2000)
    assert not memory.private_weights(model, 0, thp="madvise", available=1999)  # > half
    assert not memory.private_weights(model, 0, thp="never", available=10**9)
    assert not memory.private_weights(model, -1, thp="madvise", available=10**9)  # on the GPU
    monkeypatch.setenv("SPECEE_CPP_HUGEPAGES", "0")
    assert not memory.private_weights(model, 0, thp="madvise", available=10**9)
    assert "off" in memory.describe() or memory.thp_mode() is None


@pytest.mark.skipif(memory.thp_mode() not in ("always", "madvise"),
                    reason="this kernel offers no transparent huge pages")
def test_buffers_on_huge_pages_and_output_unchanged(small_model):
    """A private copy of the weights lands on huge pages (the patch's advice; under THP
    "madvise" nothing else would put it there), and greedy output is the same token for
    token whether the weights are mapped, private on huge pages, or private on 4 KiB pages."""
    def run(mmap: bool, pages: str) -> tuple[list[int], int]:
        """Output and this model's huge pages (held while loaded minus after close), in a
        fresh process: in the full suite's process the count read 0 MiB on a Xeon with AMX
        while the same test alone passed, the process's earlier models shaping what a new
        load gets."""
        out = child_run(str(small_model), mmap=mmap, huge_pages=pages == "1")
        return out["tokens"], out["huge"] - out["after"]

    mapped, _ = run(True, "1")
    private, huge = run(False, "1")
    assert private == mapped
    # SmolLM2-135M's weights are ~140 MiB: most of them on 2 MiB pages
    assert huge >= 32 << 20, f"only {huge >> 20} MiB on huge pages"
    if memory.thp_mode() == "madvise":   # under "always" the kernel does it anyway
        small, huge_off = run(False, "0")
        assert small == mapped
        assert huge_off < 8 << 20, f"{huge_off >> 20} MiB on huge pages with the advice off"
