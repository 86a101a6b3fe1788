"""Running the peers: llama.cpp's speculative tools as subprocesses, parsed from their
output, and llama-cpp-python's prompt-lookup decoding in process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import LoadConfig
from ..errors import SpeceeError
from ..paths import home
from .configs import BenchConfig

TOOLS = ("llama-speculative-simple", "llama-lookup", "llama-lookup-create")
BUILD_HINT = "python scripts/build_peers.py"


@dataclass(frozen=True)
class PeerRun:
    """What one peer run reports, in the fields of our Stats."""

    text: str
    n_prompt: int
    prefill_s: float
    n_gen: int
    decode_s: float
    n_decode: int                   # tokens whose forward pass falls inside decode_s
    n_drafted: int | None = None
    n_accept: int | None = None


def _exe(name: str) -> str:
    return name + (".exe" if sys.platform == "win32" else "")


def tools_dir() -> Path:
    """The folder of the built llama.cpp tools: ``$SPECEE_CPP_TOOLS`` or the newest complete
    build under ``<home>/tools``."""
    env = os.environ.get("SPECEE_CPP_TOOLS")
    candidates = [Path(env)] if env else sorted(
        (home() / "tools").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for d in candidates:
        if all((d / _exe(t)).is_file() for t in TOOLS):
            return d
    where = env or str(home() / "tools")
    raise SpeceeError(f"llama.cpp peer tools not found in {where}; build them with {BUILD_HINT}")


_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"\bn_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"\bn_accept\s*=\s*(\d+)")


def parse_output(stdout: str, stderr: str, prompt_text: str, eog_texts: tuple[str, ...] = (),
                 first_in_prefill: bool = False) -> PeerRun:
    """Parse `llama-speculative-simple` / `llama-lookup` output.

    stdout is "\\n\\n" + the prompt's pieces + the generated pieces + "\\n\\n" (+ "\\n\\n" at
    exit); the timings and draft counts are log lines on stderr. A trailing end-of-generation
    piece (llama-lookup prints it) is cut from the text. ``first_in_prefill``: the tool's
    first token comes from the prompt's logits (llama-lookup), so its "decoded" time covers
    one token fewer than it counts; llama-speculative-simple computes it in the decode loop.
    """
    def grab(rx: re.Pattern, what: str) -> re.Match:
        m = rx.search(stderr)
        if m is None:
            raise SpeceeError(f"could not find '{what}' in the peer's log; last lines:\n"
                              + "\n".join(stderr.strip().splitlines()[-8:]))
        return m

    enc, dec = grab(_ENCODED, "encoded N tokens"), grab(_DECODED, "decoded N tokens")
    body = stdout[2:] if stdout.startswith("\n\n") else stdout
    # The prompt is echoed as token pieces, which may differ from the text by a BOS piece.
    at = body.find(prompt_text)
    if at < 0:
        raise SpeceeError("the peer's output does not start with the prompt; "
                          f"first characters: {body[:80]!r}")
    text = body[at + len(prompt_text):]
    for tail in ("\n\n\n\n", "\n\n"):
        if text.endswith(tail):
            text = text[:-len(tail)]
            break
    for eog in eog_texts:
        if eog and eog in text:
            text = text[:text.index(eog)]
    drafted, accept = _DRAFTED.search(stderr), _ACCEPT.search(stderr)
    n_gen = int(dec.group(1))
    return PeerRun(text=text, n_prompt=int(enc.group(1)), prefill_s=float(enc.group(2)),
                   n_gen=n_gen, decode_s=float(dec.group(2)),
                   n_decode=n_gen - 1 if first_in_prefill else n_gen,
                   n_drafted=int(drafted.group(1)) if drafted else None,
                   n_accept=int(accept.group(1)) if accept else None)


class LlamaCppPeers:
    """Runs the llama.cpp tools on one target (+ draft) with our load settings."""

    def __init__(self, target: Path, draft: Path | None, cfg: LoadConfig,
                 eog_texts: tuple[str, ...] = (), tools: Path | None = None,
                 static_cache: Path | None = None, timeout_s: float = 900):
        self.target, self.draft, self.cfg = Path(target), draft, cfg
        self.tools = tools or tools_dir()
        self.eog_texts = eog_texts
        self.static_cache = static_cache
        self.timeout_s = timeout_s

    def argv(self, config: BenchConfig, prompt_file: Path, n_ctx: int, max_tokens: int
             ) -> list[str]:
        cfg = self.cfg
        argv = [str(self.tools / _exe(config.tool)), "-m", str(self.target),
                "-f", str(prompt_file), "-n", str(max_tokens), "-c", str(n_ctx),
                "-t", str(cfg.threads),
                # --no-escape: the prompt is text, not a C string ("\\n" in code stays)
                "--no-escape", "--temp", "0", "--top-k", "1", "--seed", "1", *config.args]
        if cfg.n_gpu_layers:
            argv += ["-ngl", str(cfg.n_gpu_layers)]
        if config.needs_draft:
            if self.draft is None:
                raise SpeceeError(f"configuration {config.name} needs a draft model (--draft)")
            argv += ["-md", str(self.draft)]
            if cfg.n_gpu_layers:
                argv += ["-ngld", str(cfg.n_gpu_layers)]
        if config.static_cache:
            if self.static_cache is None:
                raise SpeceeError(f"configuration {config.name} needs a static n-gram cache")
            argv += ["-lcs", str(self.static_cache)]
        return argv

    def run(self, config: BenchConfig, prompt_text: str, n_prompt: int, max_tokens: int
            ) -> PeerRun:
        with tempfile.TemporaryDirectory() as tmp:
            pf = Path(tmp) / "prompt.txt"
            # llama.cpp drops one trailing newline of a prompt file: add the one it drops
            pf.write_bytes((prompt_text + "\n").encode("utf-8"))
            # room for the prompt, the tokens and a draft past the last one
            argv = self.argv(config, pf, n_prompt + max_tokens + 64, max_tokens)
            try:
                r = subprocess.run(argv, capture_output=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise SpeceeError(f"{config.tool} ran past {self.timeout_s:.0f} s") from None
        out, err = (r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace"))
        if r.returncode != 0:
            raise SpeceeError(f"{config.tool} exited with {r.returncode}; last lines:\n"
                              + "\n".join(err.strip().splitlines()[-8:]))
        return parse_output(out, err, prompt_text, self.eog_texts,
                            first_in_prefill=config.tool == "llama-lookup")


def stdlib_corpus(max_mb: float) -> str:
    """Python standard library sources, up to ``max_mb`` MB: a corpus every machine has, and
    no benchmark prompt is in it (llama.cpp's static n-gram cache is built from it)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(t)
        size += len(t)
        if size >= max_mb * 1e6:
            break
    return "\n".join(parts)[:int(max_mb * 1e6)]


def static_cache(target: Path, fingerprint: str, max_mb: float, tools: Path | None = None
                 ) -> Path:
    """llama-lookup's static n-gram cache for this tokenizer, built once with
    llama-lookup-create from the stdlib corpus and cached."""
    out = home() / "lookup" / f"{fingerprint}-stdlib{max_mb:g}mb.bin"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tools = tools or tools_dir()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(stdlib_corpus(max_mb), encoding="utf-8")
        partial = out.with_name(out.name + ".partial")
        t0 = time.perf_counter()
        r = subprocess.run([str(tools / _exe("llama-lookup-create")), "-m", str(target),
                            "-f", str(corpus), "-lcs", str(partial), "-c", "512"],
                           capture_output=True, text=True, errors="replace")
        if r.returncode != 0 or not partial.is_file():
            raise SpeceeError("llama-lookup-create failed; last lines:\n"
                              + "\n".join(r.stderr.strip().splitlines()[-8:]))
        os.replace(partial, out)
        print(f"built the static n-gram cache {out.name} in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    return out


class PromptLookupPeer:
    """llama-cpp-python's ``Llama`` with ``LlamaPromptLookupDecoding`` (its defaults)."""

    def __init__(self, target: Path, cfg: LoadConfig, n_ctx: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # Flash attention on, as llama.cpp's default (auto) does on CPU and our contexts do.
        # logits_all=True by hand: Llama sizes its score buffer from the argument, not from
        # the draft model's need, and overflows it past n_batch tokens otherwise. That buffer
        # is n_ctx x n_vocab floats, hence an n_ctx fitted to the run's longest prompt.
        self.llm = Llama(model_path=str(target), n_ctx=n_ctx, n_batch=cfg.n_batch,
                         n_threads=cfg.threads, n_gpu_layers=cfg.n_gpu_layers, flash_attn=True,
                         logits_all=True, draft_model=LlamaPromptLookupDecoding(),
                         verbose=False)

    def run(self, tokens: list[int], max_tokens: int) -> PeerRun:
        self.llm.reset()
        t0 = time.perf_counter()
        t_first = None
        pieces = []
        for chunk in self.llm.create_completion(tokens, max_tokens=max_tokens, temperature=0.0,
                                                top_k=1, stream=True):
            if t_first is None:
                t_first = time.perf_counter()
            pieces.append(chunk["choices"][0]["text"])
        t_end = time.perf_counter()
        t_first = t_first or t_end
        text = "".join(pieces)
        # Chunks are not tokens (UTF-8 bytes are held back), nor is the cache length (it
        # keeps rejected drafts): count the text's tokens. The first came with the prompt.
        n_gen = len(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        return PeerRun(text=text, n_prompt=len(tokens), prefill_s=t_first - t0,
                       n_gen=n_gen, decode_s=t_end - t_first, n_decode=max(n_gen - 1, 0))

    def close(self) -> None:
        self.llm.close()
