#!/usr/bin/env python3
"""Check that compiled AMX code stores the tile configuration before loading it.

GCC 12 at -O3 dropped the stores of rows[]/colsb[] into the 64-byte tile configuration of
ggml's AMX kernels (ggml_tile_config_init), so `ldtilecfg` read stack garbage and faulted
(docs/kernels.md; fixed by patches/0003). This reads the machine code of a built library or
object file (objdump) and, for every `ldtilecfg OFF(%REG)`, looks at the instructions before
it in the same function for a store of non-zero content into bytes 16..63 of the
configuration (colsb[] at 16, rows[] at 48). Zeroing the struct and setting palette_id, and
nothing else, is the miscompilation.

    python scripts/check_amx_codegen.py path/to/libggml-cpu.so   # exit 0 ok or no AMX code, 1 broken

Standard library only; needs binutils' objdump (x86-64 Linux; elsewhere it says so, exit 0).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

WINDOW = 48  # instructions looked at before each ldtilecfg
_LDTILECFG = re.compile(r"\bldtilecfg\s+(-?0x[0-9a-f]+|-?\d+)?\((%\w+)\)")
_INSN = re.compile(r"^\s*[0-9a-f]+:\s+(\S+)\s*(.*)$")
_FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_MEM = re.compile(r"(-?0x[0-9a-f]+|-?\d+)?\((%\w+)\)$")
_ZERO_IDIOMS = ("pxor", "vpxor", "vpxord", "vpxorq", "xorps", "vxorps", "xor")
_WIDTH = {"b": 1, "w": 2, "l": 4, "q": 8}


def _canon(reg: str) -> str:
    """%xmmN, %ymmN, %zmmN name one register (a VEX write to xmmN zeroes the rest)."""
    m = re.match(r"%[xyz]mm(\d+)$", reg)
    return f"vec{m.group(1)}" if m else reg


def _num(s: str | None) -> int:
    return int(s, 0) if s else 0


def _reg_width(reg: str) -> int:
    return {"z": 64, "y": 32, "x": 16}.get(reg.lstrip("%")[0], 8)


def _store(mnemonic: str, operands: str) -> tuple[str, str, int, int] | None:
    """(source, base register, offset, width) of a store to memory, else None."""
    parts = [p.strip() for p in re.split(r",(?![^(]*\))", operands)]
    if len(parts) != 2 or not mnemonic.startswith(("mov", "vmov")):
        return None
    src, dst = parts
    m = _MEM.match(dst)
    if not m:
        return None
    if src.startswith("%"):
        width = _reg_width(src) if src[1] in "xyz" and "mm" in src else _WIDTH.get(mnemonic[-1], 8)
    else:
        width = _WIDTH.get(mnemonic[-1], 8)
    return src, m.group(2), _num(m.group(1)), width


def check_disassembly(text: str) -> tuple[int, list[str]]:
    """(number of ldtilecfg found, problems)."""
    func, window, found, problems = "?", [], 0, []
    for line in text.splitlines():
        fm = _FUNC.match(line)
        if fm:
            func, window = fm.group(1), []
            continue
        im = _INSN.match(line)
        if not im:
            continue
        mnemonic, operands = im.group(1), im.group(2).split("#")[0].strip()
        lm = _LDTILECFG.search(line)
        if lm:
            found += 1
            base_off, base_reg = _num(lm.group(1)), lm.group(2)
            zero: set[str] = set()
            content = False
            for mn, ops in window:
                parts = [p.strip() for p in re.split(r",(?![^(]*\))", ops)]
                st = _store(mn, ops)
                if st is not None and st[1] == base_reg:
                    src, _, off, width = st
                    lo, hi = off - base_off, off - base_off + width
                    is_zero = _canon(src) in zero or src in ("$0x0", "$0")
                    if hi > 16 and lo < 64 and not is_zero:
                        content = True
                    continue
                dst = parts[-1] if parts else ""
                if mn in _ZERO_IDIOMS and len(parts) >= 2 and len({_canon(x) for x in parts}) == 1:
                    zero.add(_canon(dst))
                elif dst.startswith("%"):
                    zero.discard(_canon(dst))
            if not content:
                problems.append(f"{func}: ldtilecfg at {base_off:#x}({base_reg}) without stores of "
                                f"rows/colsb before it")
            window = []
            continue
        window.append((mnemonic, operands))
        del window[:-WINDOW]
    return found, problems


def check_file(path: Path) -> tuple[bool, str]:
    objdump = shutil.which("objdump")
    if objdump is None:
        return True, "objdump not found: AMX code generation not checked"
    r = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return True, f"objdump could not read {path}: not checked"
    found, problems = check_disassembly(r.stdout)
    if not found:
        return True, f"{path.name}: no AMX tile configuration (AMX not compiled in)"
    if problems:
        return False, (f"{path.name}: {len(problems)} of {found} AMX tile configurations are "
                       f"miscompiled ({problems[0]}); apply patches/0003 or build without AMX")
    return True, f"{path.name}: {found} AMX tile configuration(s) stored before ldtilecfg"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    ok, msg = check_file(Path(argv[0]))
    print(msg if ok else f"error: {msg}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
