"""One benchmark run end to end: select prompts and configurations, load the models and
peers, measure (resumably), then write JSON, markdown and PNG next to the raw records."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from ..config import N_CTX, LoadConfig
from ..errors import SpeceeError
from ..provenance import code_id, describe, machine
from . import configs as configs_mod
from . import prompts as prompts_mod
from .report import markdown, summarize, write_json, write_png


@dataclass(frozen=True)
class BenchOptions:
    model: str
    draft: str | None = None
    prompts: str = str(prompts_mod.DEV_PROMPTS)   # JSONL path, humaneval(-edit|-refactor):LO-HI
    configs: str = "quick"
    per_category: int = 3
    max_tokens: int = 64
    max_prompt_tokens: int = 0        # >0: cut longer user messages in the middle
    turns: int = 1                    # multi-turn records: also their turns 2..turns
    categories: str = ""              # comma-separated categories to keep ("": all)
    exclude_calibration: int = 64     # Spec-Bench files: skip spread(n, this) (fitting prompts)
    out: str = "bench/run"            # prefix of .jsonl (raw), .json, .md, .png
    threads: int = 0
    gpu_layers: int = 0
    n_ctx: int = N_CTX
    static_corpus_mb: float = 8.0
    fresh: bool = False
    repeats: int = 1                  # measurements of each (prompt, configuration)

    def command(self, title: str = "") -> str:
        """The command line that makes this run: the options that differ from the
        defaults, in a fixed order (what a report quotes above each table)."""
        import shlex

        argv = ["specee-cpp", "bench", self.model]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _FLAGS and value != f.default:
                argv += [_FLAGS[f.name]] + ([] if value is True else [str(value)])
        if title:
            argv += ["--title", title]
        return shlex.join(argv)

    def settings(self) -> dict:
        """What makes records comparable: a resumed run must use the same, on the same
        machine and build (provenance.machine) and with the same code (provenance.code_id:
        a rerun after a change measures again rather than reporting the old records)."""
        keep = ("model", "draft", "prompts", "max_tokens", "max_prompt_tokens", "threads",
                "gpu_layers", "turns", "categories")
        out = {k: v for k, v in asdict(self).items() if k in keep}
        out["machine"] = machine(LoadConfig(n_threads=self.threads).threads)
        out["code"] = code_id()
        return out


_FLAGS = {"draft": "--draft", "prompts": "--prompts", "configs": "--configs",
          "per_category": "--per-category", "max_tokens": "--max-tokens",
          "max_prompt_tokens": "--max-prompt-tokens", "turns": "--turns",
          "categories": "--categories",
          "exclude_calibration": "--exclude-calibration", "out": "--out",
          "threads": "--threads", "gpu_layers": "--gpu-layers", "n_ctx": "--n-ctx",
          "fresh": "--fresh", "repeats": "--repeats"}


def select_prompts(opts: BenchOptions) -> list[prompts_mod.BenchPrompt]:
    all_p = prompts_mod.load(opts.prompts)
    exclude = set()
    if not opts.prompts.startswith(prompts_mod.HUMANEVAL_SOURCES) and opts.exclude_calibration:
        exclude = {p.id for p in prompts_mod.fitting_pool(all_p, opts.exclude_calibration)}
    chosen = prompts_mod.per_category(all_p, opts.per_category, exclude)
    if opts.categories:
        wanted = {c.strip() for c in opts.categories.split(",") if c.strip()}
        unknown = wanted - {p.category for p in all_p}
        if unknown:
            raise SpeceeError(f"no category {sorted(unknown)[0]!r} in {opts.prompts} (its "
                              f"categories: {', '.join(sorted({p.category for p in all_p}))})")
        chosen = [p for p in chosen if p.category in wanted]
    if not chosen:
        raise SpeceeError(f"no prompts left in {opts.prompts} after excluding "
                          f"{len(exclude)} calibration prompts")
    return chosen


def shorten(prompt: prompts_mod.BenchPrompt, model, max_tokens: int) -> prompts_mod.BenchPrompt:
    """Cut a user message longer than ``max_tokens`` tokens in its middle, keeping the head
    and the tail (where Spec-Bench puts the instruction and the question)."""
    toks = model.tokenize(prompt.text, add_special=False)
    if max_tokens <= 0 or len(toks) <= max_tokens:
        return prompt
    half = max_tokens // 2

    def text(ids):
        return b"".join(model.token_to_piece(t) for t in ids).decode("utf-8", "replace")

    return replace(prompt, text=text(toks[:half]) + " [...] " + text(toks[-half:]))


def _check_settings(raw: Path, opts: BenchOptions) -> None:
    meta = raw.with_suffix(".settings.json")
    if opts.fresh:
        for p in (raw, meta, raw.with_suffix(".answers.json")):
            p.unlink(missing_ok=True)
    if raw.exists() and meta.exists():
        old = json.loads(meta.read_text())
        if old != opts.settings():
            diff = {k: (old.get(k), v) for k, v in opts.settings().items() if old.get(k) != v}
            raise SpeceeError(f"{raw} holds records measured with other settings {diff}; "
                              f"pass --fresh or another --out")
    raw.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(opts.settings()))


def run(opts: BenchOptions, progress: Callable[[int, int, str], None] | None = None,
        title: str = "") -> dict:
    """Measure, write the outputs, return the summary. On Ctrl-C the records measured so far
    are summarized and written before the interrupt goes on."""
    from ..engine.llm import LLM
    from ..models.head import full_head_file
    from ..speculative.mode import choose_variant
    from .peers import LlamaCppPeers, static_cache, tools_dir
    from .runner import HISTORY_TOKENS, Runner, load_records

    if opts.max_tokens < 1:
        raise SpeceeError(f"--max-tokens must be positive, got {opts.max_tokens}")
    if opts.turns < 1:
        raise SpeceeError(f"--turns must be at least 1, got {opts.turns}")
    command = opts.command(title)
    configs = configs_mod.select(opts.configs)
    chosen = select_prompts(opts)
    prefix = Path(opts.out)
    raw = prefix.with_suffix(".jsonl")
    _check_settings(raw, opts)
    where = opts.settings()["machine"]
    cfg = LoadConfig(n_ctx=opts.n_ctx, n_threads=opts.threads, n_gpu_layers=opts.gpu_layers)
    with LLM(opts.model, draft=opts.draft, config=cfg) as llm:
        chosen = prompts_mod.with_turns(
            [shorten(p, llm.model, opts.max_prompt_tokens) for p in chosen], opts.turns)
        peers = peer_draft = None
        if any(c.kind == "llama.cpp" for c in configs):
            tools = tools_dir()
            m = llm.model
            eog = tuple(m.token_text(t) for t in range(m.n_vocab) if m.is_eog(t))
            cache = None
            if any(c.static_cache for c in configs):
                cache = static_cache(m.path, m.info.tokenizer_fingerprint,
                                     opts.static_corpus_mb, tools)
            if llm.draft_path is not None and any(c.needs_draft for c in configs
                                                  if c.kind == "llama.cpp"):
                if llm.draft_auto:
                    # the variant our modes will draft with, chosen now: the peers draft
                    # with the same weights from their first prompt
                    choose_variant(llm)
                peer_draft = full_head_file(llm.draft_path)
            peers = LlamaCppPeers(m.path, peer_draft, cfg,
                                  eog_texts=eog, tools=tools, static_cache=cache)
        runner = Runner(llm, configs, opts.max_tokens, peers, repeats=opts.repeats)
        try:
            runner.run(chosen, raw, progress=progress)
        finally:
            runner.close()
            # also on Ctrl-C: whatever was measured is summarized
            records = [r for r in load_records(raw) if r.prompt_id in {p.id for p in chosen}
                       and r.config in {c.name for c in configs}]
            summary = summarize(records, configs, opts.max_tokens)
            if summary["prompts"]:
                cut = (f", user messages over {opts.max_prompt_tokens} tokens cut in the "
                       f"middle" if opts.max_prompt_tokens else "")
                turns = (f", turns 2..{opts.turns} of multi-turn records through the chat path "
                         f"(earlier turns answered by plain greedy decoding, "
                         f"{HISTORY_TOKENS} tokens at most)" if opts.turns > 1 else "")
                excluded = (", calibration prompts excluded" if opts.exclude_calibration
                            else "")
                settings = (f"{Path(opts.prompts).name} ({opts.per_category or 'all'} per category"
                            f"{excluded}{cut}{turns}), chat template for chat prompts, greedy, "
                            f"{opts.max_tokens} new tokens, {cfg.threads} threads, configurations "
                            f"interleaved prompt by prompt (their order rotated), every "
                            f"configuration from an empty KV cache; measured on "
                            f"{describe(where)};")
                if peer_draft is not None:
                    settings += (f" draft file: {llm.draft_path.name} (ours), "
                                 f"{peer_draft.name} (llama.cpp's tools);")
                md = markdown(summary, command, settings)
                prefix.with_suffix(".md").write_text(md)
                write_json(prefix.with_suffix(".json"), command, dict(asdict(opts), machine=where),
                           summary, records)
                write_png(prefix.with_suffix(".png"), summary, title)
    return summary
