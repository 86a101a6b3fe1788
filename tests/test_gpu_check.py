"""scripts/gpu_check.py --cpu: the GPU check's own code path on the CPU backend with small
shapes (prepare the pruned sources, build libllama from them with CMake, run the patch's tests
against that build, measure the cost table, staged exits and the controller replay)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts_path import scripts_on_path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"

pytestmark = pytest.mark.model   # builds the library (cached) and runs real decodes


def test_keep_member_prunes_what_the_build_does_not_read():
    with scripts_on_path():
        import gpu_check

    keep = gpu_check.keep_member
    assert keep("llama_cpp/llama_cpp.py") and not keep("llama_cpp/lib/libllama.so")
    assert keep("vendor/llama.cpp/src/llama-context.cpp")
    assert keep("vendor/llama.cpp/ggml/src/ggml.c")
    assert keep("vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu")
    assert keep("vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp")
    assert not keep("vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp")
    assert not keep("vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf")
    assert not keep("vendor/llama.cpp/docs/build.md")
    assert not keep("vendor/llama.cpp/tools/server/server.cpp")


def test_gpu_check_cpu_path(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=1500,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["backend"] == "CPU" and not rep["skipped"]
    assert set(rep["steps_s"]) == {"unpack", "build", "load probe", "patch tests", "measure"}
    # every way of loading the probe's model loads and decodes on the CPU backend
    assert rep["load"] == {v: 0 for v in ("default", "cpu-only", "no-extra-bufts", "no-host",
                                         "no-mmap", "no-arch-query", "llama-log")}
    assert "decoded" in (out / "load-probe.log").read_text()
    assert rep["tests"]["returncode"] == 0 and "passed" in rep["tests"]["summary"]
    man = rep["manifest"]
    assert man["files_kept"] < man["files_in_sdist"] and man["total_bytes"] < 48 * 2**20
    assert man["patches"] == sorted(p.name for p in (REPO / "patches").glob("*.patch"))
    m = rep["measure"]
    assert m["shapes"] == "small" and m["gpu_layers"] == 0
    assert "Q4_K" in m["target_types"]          # quantized on the spot
    assert [c["context"] for c in m["costs"]][0] >= 64
    v = m["costs"][0]["verify_rel"]
    assert set(map(int, v)) == set(range(1, 17)) and all(x > 0 for x in v.values())
    assert m["costs"][0]["draft_token_rel"] > 0
    # the draft's attention chosen as the runtime does, before the table
    a = m["draft_attention"]
    assert a["contexts"] == [128, 1024] and a["chosen"] in ("off", "default")
    assert all(x > 0 for x in a["default"] + a["off"])
    assert {"staged-full", "probes-8"} <= set(m["staged"]["rel"])
    assert any(k.startswith("exit-") for k in m["staged"]["rel"])
    pol = m["replay"]["policies"]
    assert {"1", "4", "auto", "stop"} <= set(pol) and all(p["speedup"] > 0 for p in pol.values())
    md = (out / "gpu_check.md").read_text()
    assert "| policy |" in md and "Patch tests" in md and "Draft attention: flash attention" in md
