"""Weights on huge pages (memory.py, patches/0008): the policy read from sysfs, the
choice between mapping the file and a private copy, and on a real model that the patched
ggml's buffers do land on 2 MiB pages and that the output does not depend on where they are."""
from __future__ import annotations

import pytest

from specee_cpp import memory
from scripts_path import scripts_on_path


def load_pages_check():
    """scripts/pages_check.py as a module (its fresh-process runs of our loop)."""
    with scripts_on_path():
        import pages_check
    return pages_check


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
    pages_check = load_pages_check()

    def run(mmap: bool, pages: str) -> tuple[list[int], int]:
        """Output and this model's huge pages (held while loaded minus after close), in a
        fresh process: in the full suite's process the count read 0 MiB on a Xeon with AMX
        while the same test alone passed, the process's earlier models shaping what a new
        load gets."""
        out = pages_check.child_run(str(small_model), mmap=mmap, huge_pages=pages == "1",
                                    text="The capital of France is", max_tokens=16,
                                    n_ctx=512)
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


def test_pages_check_script_measures_every_setting(small_model, monkeypatch, capsys):
    """scripts/pages_check.py on the small model: one prompt, each setting in its own
    process, llama.cpp's loop and the script's own process beside them; the table has every
    setting with a speed."""
    import sys

    pages_check = load_pages_check()
    monkeypatch.setattr(sys, "argv", ["pages_check.py", str(small_model), "--limit", "1",
                                      "--rounds", "1", "--max-tokens", "4", "--long-lived"])
    assert pages_check.main() == 0
    out = capsys.readouterr().out
    rows = {ln.split(" | ")[0].strip("| "): ln.split(" | ") for ln in out.splitlines()
            if ln.startswith("| ") and not ln.startswith("| setting")}
    assert set(rows) == set(pages_check.SETTINGS) | {"long-lived"}
    assert all(float(r[1]) > 0 and r[2].endswith("x") for r in rows.values())
    if memory.thp_mode() == "madvise":   # under "always" the kernel gives huge pages anyway
        assert rows["4k-mapped"][3].startswith("0 MiB")
        assert not rows["huge-private"][3].startswith("0 MiB")
    assert "against `lcpp-plain`" in out
