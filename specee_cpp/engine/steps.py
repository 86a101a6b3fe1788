"""The one step record, and the stream wrapper that turns steps into text and statistics.

Every decoding strategy (plain, speculative, early exit) is a generator of :class:`Step`.
:func:`stream` is the only place that detokenizes, applies stop conditions and times a
generation; the CLI, the Python API and the benchmark all consume its output.
"""
from __future__ import annotations

import codecs
import difflib
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator


@dataclass(frozen=True)
class Stats:
    """Totals of one generation; JSON-ready via ``as_dict``."""

    n_prompt: int
    n_gen: int
    prefill_s: float
    decode_s: float
    n_drafted: int = 0
    n_accept: int = 0
    # tokens whose forward pass falls in decode_s: every step after the first (which comes
    # from the prefill's logits), a final end-of-generation token included
    n_decode: int = 0
    exit_layers: dict[int, int] = field(default_factory=dict)   # exit layer -> count
    # speculative rounds: [drafted at position i, accepted at position i] for i = 0, 1, ...
    accept_by_pos: list[list[int]] = field(default_factory=list)
    # where the drafts came from (model, context, history) -> [drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)     # seconds by phase
    finish_reason: str = "length"
    note: str = ""                # the mode's note (spec: which draft, or why none)
    # with a predicted output: its tokens that appear in the output and those that do not
    # (OpenAI's accepted_/rejected_prediction_tokens); None without one
    prediction: tuple[int, int] | None = None
    # prompt tokens the target's cache held from the previous generation, not read again
    # (OpenAI's cached_tokens)
    n_cached: int = 0

    @property
    def decode_tps(self) -> float:
        """Decode tokens/s: the one definition (the CLI's line, the API, the benchmark)."""
        return self.n_decode / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens read per second (those found cached were not read)."""
        n_read = self.n_prompt - self.n_cached
        return n_read / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.n_accept / self.n_drafted if self.n_drafted else None

    def as_dict(self) -> dict:
        return {
            "n_prompt": self.n_prompt, "n_cached": self.n_cached, "n_gen": self.n_gen,
            "n_decode": self.n_decode,
            "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
            "prefill_tps": round(self.prefill_tps, 3), "decode_tps": round(self.decode_tps, 3),
            "n_drafted": self.n_drafted, "n_accept": self.n_accept,
            "acceptance": self.acceptance,
            "acceptance_by_position": [round(a / d, 4) if d else None
                                       for d, a in self.accept_by_pos],
            "drafted_by_source": {k: {"drafted": d, "accepted": a}
                                  for k, (d, a) in sorted(self.by_source.items())},
            "exit_layers": {str(k): v for k, v in sorted(self.exit_layers.items())},
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
            "finish_reason": self.finish_reason, "note": self.note,
            **({"prediction": {"accepted": self.prediction[0], "rejected": self.prediction[1]}}
               if self.prediction is not None else {}),
        }


@dataclass(frozen=True)
class Step:
    """One emitted token.

    Strategies fill the first group of fields; :func:`stream` fills ``text`` and, on the
    last step, ``finish_reason`` and ``stats``. A round of drafts yields its kept drafted
    tokens (``drafted``), then its last token with the round's timings and counts.
    """

    token: int
    exit_layer: int | None = None   # layer the target exited at, None for full depth
    n_drafted: int = 0              # tokens drafted in the round this token ends
    n_accept: int = 0               # of which accepted
    source: str | None = None       # who drafted them: model, context or history
    drafted: bool = False           # a kept drafted token: its round's last step follows
    # seconds spent producing this token, by phase: prefill, decode, draft, layers, probe, head
    timings: dict[str, float] = field(default_factory=dict)
    text: str = ""
    finish_reason: str | None = None  # stop | length | stop_string
    stats: Stats | None = None
    note: str | None = None           # what the mode chose (e.g. its draft), once per run


class Detokenizer:
    """Incremental bytes -> text: holds back incomplete UTF-8 sequences between tokens."""

    def __init__(self, piece: Callable[[int], bytes]):
        self._piece = piece
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._utf8.decode(self._piece(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def stop_at(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first of the stop strings begins in ``text``, or None: generation's cut
    and the benchmark's cut of the peers' outputs are this one rule."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def stream(steps: Iterable[Step], *, piece: Callable[[int], bytes], is_eog: Callable[[int], bool],
           max_tokens: int, n_prompt: int, stop: tuple[str, ...] = (),
           prediction: list[int] | None = None,
           cached: Callable[[], int] = lambda: 0) -> Iterator[Step]:
    """Run a strategy until an end-of-generation token, ``max_tokens`` or a stop string.

    Yields each step with its text piece; the last step carries ``finish_reason`` and
    ``stats``. An end-of-generation token is reported in the last step with empty text and
    is not counted in ``n_gen``. Text that might be the start of a stop string is held back
    until it is known not to be. Where the output ends inside a round of drafts, the rest of
    the round (computed already) is read for its counts, which its last step carries. With
    ``prediction`` (the caller's predicted output's tokens) the stats count its tokens that
    appear in the output. ``cached()``: the prompt tokens the strategy found in the cache,
    asked once it has read the prompt.
    """
    emitted: list[int] = []   # with a prediction: the output's tokens
    detok = Detokenizer(piece)
    hold = max((len(s) for s in stop), default=1) - 1
    pending = ""                      # text not yet released (possible stop-string prefix)
    totals: Counter[str] = Counter()
    exits: Counter[int] = Counter()
    n_gen = n_steps = n_drafted = n_accept = 0
    note = ""
    by_pos: list[list[int]] = []
    by_source: dict[str, list[int]] = {}
    t_start = time.perf_counter()

    def finish(step: Step, text: str, reason: str) -> Step:
        decode_s = time.perf_counter() - t_start - totals["prefill"]
        stats = Stats(n_prompt=n_prompt, n_gen=n_gen, prefill_s=totals["prefill"],
                      decode_s=max(decode_s, 0.0), n_drafted=n_drafted, n_accept=n_accept,
                      n_decode=max(n_steps - 1, 0),
                      accept_by_pos=[list(x) for x in by_pos],
                      by_source={k: list(v) for k, v in by_source.items()},
                      exit_layers=dict(exits), timings=dict(totals), finish_reason=reason,
                      note=note, prediction=prediction_usage(prediction, emitted)
                      if prediction is not None else None, n_cached=cached())
        return replace(step, text=text, finish_reason=reason, stats=stats)

    def count(step: Step, emitted: bool = True) -> None:
        nonlocal n_steps, note, n_drafted, n_accept
        n_steps += emitted
        note = note or step.note or ""
        totals.update(step.timings)
        n_drafted += step.n_drafted
        n_accept += step.n_accept
        if step.n_drafted:
            tally = by_source.setdefault(step.source or "model", [0, 0])
            tally[0] += step.n_drafted
            tally[1] += step.n_accept
        for i in range(step.n_drafted):  # a round accepts a prefix: positions < n_accept
            if i == len(by_pos):
                by_pos.append([0, 0])
            by_pos[i][0] += 1
            by_pos[i][1] += i < step.n_accept

    def round_end(step: Step) -> None:
        """The output ends at ``step``: if it is a drafted token, the round's counts are on
        the round's last step, already computed; read to it."""
        if not step.drafted:
            return
        for rest in it:
            count(rest, emitted=False)
            if not rest.drafted:
                return

    it = iter(steps)
    try:
        for step in it:
            count(step)
            if is_eog(step.token):
                round_end(step)
                yield finish(step, pending + detok.flush(), "stop")
                return
            n_gen += 1
            if prediction is not None:
                emitted.append(step.token)
            if step.exit_layer is not None:
                exits[step.exit_layer] += 1
            pending += detok.add(step.token)
            if stop:
                at = stop_at(pending, stop)
                if at is not None:
                    round_end(step)
                    yield finish(step, pending[:at], "stop_string")
                    return
            if n_gen >= max_tokens:
                yield finish(step, pending + detok.flush(), "length")
                return
            # never a negative cut: it would slice from the end, releasing the start of a
            # stop string still being spelled out (pieces shorter than it, e.g. digits)
            cut = max(len(pending) - hold, 0) if stop else len(pending)
            out, pending = pending[:cut], pending[cut:]
            yield replace(step, text=out)
    finally:
        close = getattr(it, "close", None)
        if close:
            close()  # lets the strategy rewind its KV state in its own finally


def prediction_usage(predicted: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens as OpenAI counts them: the prediction's tokens
    that appear in the completion (in order: the matching blocks of a diff of the two) and
    those that do not."""
    if not predicted:
        return 0, 0
    m = difflib.SequenceMatcher(None, predicted, output, autojunk=False)
    accepted = sum(b.size for b in m.get_matching_blocks())
    return accepted, len(predicted) - accepted


def with_note(steps: Iterable[Step], note: str) -> Iterator[Step]:
    """``steps`` with ``note`` on the first one (it ends up in Stats.note)."""
    it = iter(steps)
    try:
        first = next(it)
        yield replace(first, note=note)
        yield from it
    finally:
        close = getattr(it, "close", None)
        if close:
            close()


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    stats: Stats | None


class Transcript:
    """A generation accumulated step by step: the API's ``generate``, the CLI's generate
    and chat all read text, tokens and statistics from here (a reply stopped half-way
    keeps what it had)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.stats: Stats | None = None

    def add(self, step: Step) -> Step:
        self.pieces.append(step.text)
        if step.finish_reason != "stop":   # an end-of-generation token is not output
            self.tokens.append(step.token)
        self.stats = step.stats or self.stats
        return step

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def result(self) -> Result:
        return Result(text=self.text, tokens=list(self.tokens), stats=self.stats)
