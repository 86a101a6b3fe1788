"""Where a model's weights live: on 2 MiB pages where the system lets a program ask for them.

A CPU decode streams every weight once per token. On 4 KiB pages that is a TLB miss every
4 KiB; on 2 MiB pages almost none. The patched ggml asks the kernel for transparent huge
pages for every large buffer it allocates (patches/0008), which covers the repacked weights,
the KV cache and the compute buffers; the weights that llama.cpp maps straight from the GGUF
file stay on 4 KiB page-cache pages. Reading those into private memory instead (llama.cpp's
load mode "none") puts them on huge pages as well. docs/BENCHMARKS.md ("Weights on huge
pages") has what each step is worth on the machines where it was measured.

The private copy costs what mapping saves: the weights are no longer shared with the page
cache or another process, and memory the kernel could have reclaimed by dropping file pages
it now cannot (the default pair, loaded and run: 1837 MiB private and 24 MiB of file pages,
against 934 MiB private and 1547 MiB of file pages mapped; a mapped file keeps the
originals of the repacked weights resident too). So it is chosen only where huge pages are
on offer and the file fits well inside the memory available; ``SPECEE_CPP_HUGEPAGES=0``
turns both steps off.
"""
from __future__ import annotations

import os
from pathlib import Path

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MEMINFO = Path("/proc/meminfo")
# a private copy only when the file takes at most this share of the available memory: the
# page cache holds a second copy while it is read, and the draft, the KV cache and the rest
# of the user's machine need room too
MAX_SHARE = 0.5


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The system's transparent-huge-page policy ("always", "madvise" or "never", the one in
    brackets in sysfs), or None where there is none (not Linux, or a kernel without THP)."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def huge_pages_wanted() -> bool:
    """False when the user turned huge pages off (``SPECEE_CPP_HUGEPAGES=0``, read by the
    patched ggml as well)."""
    return os.environ.get("SPECEE_CPP_HUGEPAGES", "").strip() != "0"


def _kib_field(path: Path, key: str) -> int | None:
    """The value of a ``key: N kB`` line of a /proc file, in bytes (None if absent)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """Bytes of memory the kernel reports available for a new allocation (None if unknown)."""
    return _kib_field(meminfo, "MemAvailable")


def private_weights(model_path: Path, n_gpu_layers: int, thp: str | None = None,
                    available: int | None = None) -> bool:
    """Whether to read the model's weights into private memory (load mode "none") rather than
    map the file: only for a CPU model (offloaded weights live on the GPU either way), where
    huge pages are on offer and wanted, and the file takes at most MAX_SHARE of the available
    memory. ``thp`` and ``available`` default to this machine's."""
    if n_gpu_layers != 0 or not huge_pages_wanted():
        return False
    thp = thp_mode() if thp is None else thp
    if thp not in ("always", "madvise"):
        return False
    available = mem_available() if available is None else available
    if available is None:
        return False
    return Path(model_path).stat().st_size <= MAX_SHARE * available


def describe() -> str:
    """One line for `doctor`: the system's policy and what specee-cpp does with it."""
    thp = thp_mode()
    if thp is None:
        return "not available here (4 KiB pages)"
    if not huge_pages_wanted():
        return f"THP {thp}; off (SPECEE_CPP_HUGEPAGES=0)"
    if thp == "never":
        return "THP never: 4 KiB pages"
    return (f"THP {thp}: large buffers advised onto 2 MiB pages, CPU weights read "
            f"into private memory when the file takes at most {MAX_SHARE:.0%} of the "
            f"available memory")


def anon_huge_bytes(smaps: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (None where the
    kernel does not say)."""
    return _kib_field(smaps, "AnonHugePages")
