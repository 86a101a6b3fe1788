"""Crash probe: one short decode of a tiny quantized model in a child process.

A libllama built for the wrong CPU, or one whose kernels fault on this CPU (the AMX tile
configuration that GCC 12 miscompiled, see docs/kernels.md), does not raise: it kills the
process. Set-up (scripts/bootstrap.py) and `specee-cpp doctor` run this probe in a child, so
that such a build stops set-up with one line instead of crashing on the user's first prompt.

The child writes a tiny model with tile-friendly shapes (rows and vocabulary multiples of
16), quantizes it to Q4_0 with a Q4_0 head, loads it with the extra buffer types on (as users
run: AMX where compiled in, CPU_REPACK), and runs a plain decode, a staged decode with
candidate probes and an exit: every kernel family our decoding takes.

    python -m specee_cpp.crash_probe          # prints one line; exit 0 ok, 1 failed
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .provenance import AMX_ENV, amx_switched_off

PROBE_TIMEOUT_S = 300
# Test hook: the child faults on purpose (SIGSEGV through a NULL read) after loading libllama,
# so that the parent's handling of a dying child is tested with a real crash.
FAULT_ENV = "SPECEE_CPP_PROBE_FAULT"


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    message: str   # one line: what ran, or what died and what to do
    returncode: int


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _child_command() -> list[str]:
    return [sys.executable, "-m", "specee_cpp.crash_probe", "--child"]


def _run_child(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(_child_command(), env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_probe(timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Run the child; on a crash, try once more with AMX off to say which fix applies."""
    env = dict(os.environ)
    try:
        r = _run_child(env, timeout)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"the crash probe (a 6-token decode of a tiny model) hung for "
                                  f"{timeout:.0f} s", 124)
    if r.returncode == 0:
        return ProbeResult(True, (r.stdout.strip().splitlines() or ["ok"])[-1], 0)
    if r.returncode > 0:  # the child raised: its last line says why
        why = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]
        return ProbeResult(False, f"the crash probe failed (exit {r.returncode}): {why}",
                           r.returncode)
    died = f"the patched libllama crashed ({_signal_name(r.returncode)}) in a first decode " \
           f"of a tiny Q4_0 model"
    if not amx_switched_off() and FAULT_ENV not in env:
        try:
            again = _run_child(dict(env, **{AMX_ENV: "0"}), timeout)
        except subprocess.TimeoutExpired:
            again = None
        if again is not None and again.returncode == 0:
            return ProbeResult(False, f"{died}; it works with AMX off: set {AMX_ENV}=0, or "
                                      f"rebuild with CMAKE_ARGS=-DGGML_NATIVE=OFF", r.returncode)
    return ProbeResult(False, f"{died}; rebuild for a generic CPU with "
                              f"CMAKE_ARGS=-DGGML_NATIVE=OFF (python scripts/build_wheel.py "
                              f"--force), and report this CPU's `specee-cpp doctor`",
                       r.returncode)


def write_probe_model(directory: Path) -> Path:
    """The tiny Q4_0 model (Q4_0 head too), written once per directory."""
    from .bindings import quantize_file
    from .models.tiny import write_tiny_model

    out = directory / "probe-q4_0.gguf"
    if out.exists():
        return out
    f32 = directory / "probe-f32.gguf"
    write_tiny_model(f32, arch="qwen2", n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                     seed=7, extra_words=[f"▁w{i}" for i in range(320 - 269)])
    part = out.with_name(out.name + ".partial")
    quantize_file(f32, part, ftype=2, n_threads=1, head_type=2)  # MOSTLY_Q4_0, head GGML Q4_0
    os.replace(part, out)
    return out


def _child() -> int:
    import numpy as np

    from .bindings import Batch, Context, Model

    if os.environ.get(FAULT_ENV) == "segv":
        import ctypes

        ctypes.string_at(0)  # a real SIGSEGV, as a faulting kernel would give
    with tempfile.TemporaryDirectory(prefix="specee-probe-") as tmp:
        model = Model(write_probe_model(Path(tmp)))
        ctx = Context(model, n_ctx=64, n_batch=16, n_threads=min(os.cpu_count() or 1, 4))
        batch = Batch(16)
        batch.set([1, 300, 301, 302, 303, 304], 0, output_last_only=False)
        ctx.decode(batch)  # batched matmul: the AMX / repacked kernels
        logits = ctx.logits(-1)
        batch.set([int(np.argmax(logits))], 6)
        ctx.decode(batch)  # single-token matmul
        batch.set([305, 306], 7, output_last_only=False)
        ctx.stage_begin(batch)
        probe = ctx.stage_run(1, np.array([[5, 6, 7, 8]] * 2, dtype=np.int32))
        ctx.stage_exit(full_head=True)
        if not (np.all(np.isfinite(logits)) and np.all(np.isfinite(probe))):
            print("non-finite logits", file=sys.stderr)
            return 1
        ctx.close()
        model.close()
    print("crash probe ok: plain, batched and staged decode of a tiny Q4_0 model")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return _child()
    res = run_probe()
    print(res.message if res.ok else f"error: {res.message}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
