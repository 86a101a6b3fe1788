"""One CMake configure-and-build, for the scripts that build llama.cpp's own targets from
the patched or stock sources (build_peers.py, build_cpu_variants.py). Standard library
only."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from build_wheel import BuildError


def cmake_build(src: Path, bld: Path, args: list[str], targets: list[str], build_log: Path,
                env: dict | None = None, what: str = "") -> None:
    """Configure ``src`` into ``bld`` with ``args``, then build ``targets`` (Release, a job
    per core), all output to ``build_log``. A failing step is a BuildError ending with the
    log's last lines; ``what`` names the build in it."""
    jobs = str(os.cpu_count() or 2)
    with open(build_log, "w") as fh:
        for cmd in (["cmake", "-S", str(src), "-B", str(bld), *args],
                    ["cmake", "--build", str(bld), "--config", "Release", "-j", jobs,
                     "--target", *targets]):
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            if r.returncode != 0:
                tail = build_log.read_text(errors="replace")[-6000:]
                raise BuildError(f"{cmd[0]} {cmd[1]}{f' for {what}' if what else ''} failed "
                                 f"(exit {r.returncode}); last lines:\n{tail}")
