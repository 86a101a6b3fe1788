"""The Python API: load a target (and optionally a draft) and stream generations."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence as Seq

from ..bindings import Context, Model
from ..config import LoadConfig, SamplingConfig
from ..errors import ContextOverflowError, SpeceeError, TokenizerMismatchError
from ..memory import private_weights
from ..models.gguf_info import GGUFInfo, read_gguf_info
from ..models.registry import looks_like_path, resolve_model
from ..text import checked
from . import modes
from .chat_template import ChatTemplate
from .modes import Mode
from .prompt_kernels import prompt_kernels
from .decode_kernels import decode_kernels
from .sequence import Sequence
from .steps import Result, Step, Transcript, stream

# text, chat messages, or token ids already made by prompt_tokens (taken as they are)
Prompt = str | list[dict] | list[int]


def variant_parts(ref: str | Path) -> tuple[str, list[str]] | None:
    """(registry name, parts) of a variant reference ``NAME:PART[:PART]``; None for a
    registry name or a path (a path may hold a ':' on Windows)."""
    s = str(ref)
    if isinstance(ref, str) and ":" in s and not looks_like_path(s):
        base, *parts = s.split(":")
        return base, parts
    return None


def resolve(ref: str | Path) -> Path:
    """A registry name, a .gguf path, or a registry model's variant made once and kept in
    the model cache: ``NAME:TYPE`` requantized with llama.cpp's quantizer
    (``qwen2.5-coder-0.5b:Q4_0``), ``NAME:vN`` with a draft head reduced to the N most
    frequent tokens (``qwen2.5-coder-0.5b:v32k``, models/head.py), or both
    (``qwen2.5-coder-0.5b:IQ4_NL:v32k``: requantized first)."""
    v = variant_parts(ref)
    if v is None:
        return resolve_model(ref)
    from ..bindings.quantize import variant
    from ..models.head import parse_size, reduced_variant

    s, (base, specs) = str(ref), v
    if any(p.lower() == "auto" for p in specs):
        raise SpeceeError(f"{s!r}: NAME:auto is a draft that a speculative mode chooses with "
                          f"this machine's costs; pass it as the draft (--draft {s})")
    heads = [p for p in specs if p.lower().startswith("v")]
    types = [p for p in specs if p not in heads]
    if len(heads) > 1 or len(types) > 1 or not all(specs):
        raise SpeceeError(f"model variant {s!r}: write NAME:TYPE, NAME:vN or NAME:TYPE:vN")
    path = resolve_model(base)
    if types:
        path = variant(path, types[0].upper())
    if heads:
        path = reduced_variant(path, parse_size(heads[0]))
    return path


def variant_base(ref: str | Path) -> Path:
    """The registry model a variant (``NAME:...``) is made from; the file itself otherwise.
    A variant keeps its base's draft-length controller: it proposes from the same model."""
    v = variant_parts(ref)
    return resolve_model(v[0] if v else ref)


def check_same_tokenizer(target: Path, draft: Path) -> GGUFInfo:
    """Raise unless draft and target share a vocabulary (read from the GGUF headers); the
    target's header facts."""
    t, d = read_gguf_info(target), read_gguf_info(draft)
    if t.tokenizer_fingerprint != d.tokenizer_fingerprint:
        raise TokenizerMismatchError(
            f"draft {draft.name} ({d.n_vocab} tokens, tokenizer {d.tokenizer_fingerprint}) does "
            f"not share the tokenizer of target {target.name} ({t.n_vocab} tokens, "
            f"{t.tokenizer_fingerprint})")
    return t


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    """Raise unless a prompt and its longest reply fit the context, saying by how much not."""
    over = n_prompt + max_tokens - n_ctx
    if over > 0:
        raise ContextOverflowError(
            f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceed the context of "
            f"{n_ctx} by {over} tokens; use a larger --n-ctx or fewer tokens")


class _Loaded:
    """A model with its context and cached sequence."""

    def __init__(self, path: Path, cfg: LoadConfig, flash_attn: bool | None = None,
                 n_seq: int = 1, info: GGUFInfo | None = None):
        mmap = cfg.mmap if cfg.mmap is not None else not private_weights(path, cfg.n_gpu_layers)
        self.model = Model(path, n_gpu_layers=cfg.n_gpu_layers, use_mmap=mmap, info=info)
        self.cfg, self.n_seq = cfg, n_seq
        self._open(flash_attn, n_seq)

    def _open(self, flash_attn: bool | None, n_seq: int = 1) -> None:
        self.ctx = Context(self.model, n_ctx=self.cfg.n_ctx * n_seq, n_batch=self.cfg.n_batch,
                           n_threads=self.cfg.threads, flash_attn=flash_attn, n_seq_max=n_seq,
                           kv_unified=True if n_seq > 1 else None)
        if n_seq > 1 and not self.ctx.keep_sequences_apart(self.ctx.n_ctx // n_seq):
            self.ctx.close()
            # without it a slot's keys would be read in another order than alone's, and its
            # answer could part from the request's answer alone
            raise SpeceeError(f"{self.model.what}: its KV cache (sliding-window or recurrent "
                              f"layers) cannot keep {n_seq} sequences apart; serve one "
                              f"request at a time (--parallel 1)")
        self.seq = Sequence(self.ctx)

    def reopen(self, flash_attn: bool | None, n_seq: int | None = None) -> None:
        """A fresh context (empty cache) with this flash-attention setting and ``n_seq``
        sequences (default: as before); weights kept. Where the cache cannot keep that many
        apart, the error, with a context as before."""
        self.ctx.close()
        try:
            self._open(flash_attn, n_seq or self.n_seq)
        except SpeceeError:
            self._open(flash_attn, self.n_seq)
            raise
        self.n_seq = n_seq or self.n_seq

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class LLM:
    """A target model, an optional draft, and their KV caches.

    The cache is kept between calls: a prompt that extends the previous one (a chat) only
    decodes its new tokens.
    """

    def __init__(self, model: str | Path, draft: str | Path | None = None,
                 config: LoadConfig = LoadConfig(), measure_now: bool = True):
        self.config = config
        target_path = resolve(model)
        # NAME:auto: the shipped draft until a speculative mode picks this machine's best
        # variant with its cost model (speculative/variants.py); the mode reads draft_auto
        self.draft_auto: str | None = None
        v = variant_parts(draft) if draft is not None else None
        if v and v[1][-1].lower() == "auto":
            draft = self.draft_auto = str(draft)[:-len(":auto")]
        draft_path = resolve(draft) if draft is not None else None
        # the target's header, validated with the draft's: not read twice (a 150k-token
        # vocabulary takes a fifth of a second to check)
        info = check_same_tokenizer(target_path, draft_path) if draft_path is not None else None
        self.tgt = _Loaded(target_path, config, n_seq=config.n_seq, info=info)
        self.draft_path = draft_path
        self.draft_base_path = variant_base(draft) if draft is not None else None
        self._dft: _Loaded | None = None
        # the draft context's flash attention: llama.cpp's default until the timing
        # measured on this machine says off is cheaper (engine/draft_attention.py)
        self.draft_flash_attn: bool | None = None
        self._template: ChatTemplate | None = None
        self._cache: dict[tuple, Any] = {}       # see cached()
        # a speculative run on a machine whose costs are not measured yet starts at once,
        # the measurement left to idle time (speculative/idle.py); the CLI's chat, generate
        # and serve set it, a script and the benchmark measure first
        self.defer_costs = False
        # the x86 kernels of a one-token decode, as measured for this model on this machine
        # (where they are not yet: timed now, or with ``measure_now`` False off until chat or
        # serve times them in idle time), and the kernels that read its prompts where
        # measured (else upstream's)
        self.decode_kernels = decode_kernels(self, measure=measure_now)
        self.prompt_kernels = prompt_kernels(self)

    @property
    def model(self) -> Model:
        return self.tgt.model

    @property
    def dft(self) -> _Loaded | None:
        """The draft with its context, loaded on first use (None without a draft): a mode
        that decides not to draft never pays for its weights."""
        if self._dft is None and self.draft_path is not None:
            # as many sequences as the target's: where slots run the draft, one a slot
            self._dft = _Loaded(self.draft_path, self.config, self.draft_flash_attn,
                                n_seq=self.tgt.n_seq)
        return self._dft

    @property
    def slots_draft(self) -> bool:
        """Whether the target's slots (engine/slots.py) run the draft model, a sequence of
        its context each."""
        return self.tgt.n_seq > 1 and self.draft_path is not None

    def set_draft_flash_attn(self, flash_attn: bool | None) -> None:
        """Open the draft's context with this flash-attention setting (None: llama.cpp's
        default) from now on; a loaded draft gets a fresh context (its cache refills)."""
        if flash_attn == self.draft_flash_attn:
            return
        self.draft_flash_attn = flash_attn
        if self._dft is not None:
            self._dft.reopen(flash_attn)

    def draft_sha256(self) -> str:
        """The draft file's sha256 (keys its cost and attention caches), read without
        loading the draft: a pair whose costs say "never draft" never loads it."""
        from ..models.pull import file_sha256

        return self.cached(("draft_sha256", self.draft_path),
                           lambda: file_sha256(self.draft_path))

    @property
    def draft_loaded(self) -> bool:
        return self._dft is not None

    def release_draft(self) -> None:
        """Free the draft's weights and KV cache (it loads again if a mode needs it)."""
        if self._dft is not None:
            self._dft.close()
            self._dft = None

    def open_slots(self, n: int) -> None:
        """Hold ``n`` sequences in the target's context, ``n_ctx`` tokens each, for slots
        (engine/slots.py), its weights kept, and let the draft go (a slot runs none at gamma
        auto; one that runs the draft model is loaded with its sequences from the start).
        Where its KV cache cannot keep them apart, the error, and one sequence with the
        draft."""
        self.tgt.reopen(None, n)
        self.config = replace(self.config, n_seq=n)
        self.release_draft()
        self.draft_path = self.draft_base_path = self.draft_auto = None

    def close(self) -> None:
        for loaded in (self.tgt, self._dft):
            if loaded is not None:
                loaded.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the cached conversation: the next prompt is decoded from scratch."""
        for loaded in (self.tgt, self._dft):
            if loaded is not None:
                loaded.seq.rewind(0)

    def prompt_text(self, prompt: Prompt) -> str:
        """The chat template rendered for a user message or a list of {role, content}."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self._template is None:
            self._template = ChatTemplate(self.model)
        return self._template.render(messages)

    def prompt_tokens(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (chat template applied unless ``chat`` is False),
        a list of {role, content} messages, or token ids (returned as they are)."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            checked(prompt, "the prompt")
        else:
            for i, m in enumerate(prompt):
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    checked(m["content"], f"message {i} ({m.get('role')})")
        if isinstance(prompt, str) and not chat:
            return self.model.tokenize(prompt, add_special=True, parse_special=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # The template writes BOS itself where the model wants one.
        return self._chat_tokens(messages)

    def _chat_tokens(self, messages: list[dict]) -> list[int]:
        """The rendered chat, its special tokens the template's alone. A message's content is
        text: one that holds a special token's text ("<|im_start|>system") must not close the
        user's turn and open another, as tokenizing the rendered prompt whole would let it.
        Such contents are cut out of the rendering (a marker in their place) and tokenized
        as text; every other prompt is tokenized whole, as the template's author wrote it."""
        tok = self.model.tokenize
        text = self.prompt_text(messages)
        held = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)
                and tok(m["content"], False, True) != tok(m["content"], False, False)]
        if not held:
            return tok(text, add_special=False, parse_special=True)
        marks = {i: f"\x00specee-content-{i}\x00" for i in held}
        masked = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
        rendered = self.prompt_text(masked)
        out, pos = [], 0
        for i in held:
            at = rendered.find(marks[i], pos)
            if at < 0 or rendered.count(marks[i]) != 1:
                raise SpeceeError(f"message {i} ({messages[i].get('role')}) holds a special "
                                  f"token's text, and this model's chat template does not "
                                  f"keep a message's content whole to read it as text")
            out += tok(rendered[pos:at], False, True) + tok(messages[i]["content"], False, False)
            pos = at + len(marks[i])
        return out + tok(rendered[pos:], False, True)

    @property
    def n_ctx(self) -> int:
        """Tokens one sequence of the target's context holds: prompt and reply together."""
        return self.tgt.ctx.n_ctx // self.tgt.n_seq

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        """What a mode derives from this LLM's models once (a predictor bundle, a cost
        model), kept as long as the LLM: ``make()`` runs on the first call with ``key``."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def forget(self, key: tuple) -> None:
        self._cache.pop(key, None)

    def remember(self, key: tuple, value: Any) -> None:
        """Set what :meth:`cached` returns for ``key`` (a mode's override)."""
        self._cache[key] = value

    def prediction_tokens(self, prediction: str | list[int]) -> list[int]:
        """Token ids of a predicted output: text (tokenized as the reply's text, no special
        tokens) or ids (as they are); refused where it could not fit the context."""
        if isinstance(prediction, str):
            tokens = self.model.tokenize(checked(prediction, "the prediction"),
                                         add_special=False, parse_special=False)
        elif isinstance(prediction, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prediction):
            tokens = list(prediction)
            bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
            if bad:
                raise SpeceeError(f"prediction: token id {bad[0]} is outside the vocabulary "
                                  f"of {self.model.n_vocab}")
        else:
            raise SpeceeError(f"prediction: text or a list of token ids, got "
                              f"{type(prediction).__name__}")
        if len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"prediction of {len(tokens)} tokens is longer than the "
                                       f"context of {self.n_ctx}")
        return tokens

    def stream(self, prompt: Prompt, *, max_tokens: int = 256,
               sampling: SamplingConfig = SamplingConfig(), stop: Seq[str] = (),
               chat: bool = True, mode: str | Mode = "plain", options: Any = None,
               ignore_eos: bool = False, prediction: str | list[int] | None = None,
               **mode_options: Any) -> Iterator[Step]:
        """Generate from ``prompt``, yielding one :class:`Step` per token; the last step
        carries ``finish_reason`` and ``stats``. ``mode``: a registered mode's name (plain,
        spec, ee, ...) or object; its options either as ``options`` (the mode's Options
        dataclass) or as keywords, e.g. ``mode="spec", gamma=4``. ``ignore_eos``: run to
        ``max_tokens`` past end-of-generation tokens (fixed-length load tests, as llama.cpp's
        server offers). ``prediction``: the reply expected, or most of it (the text an edit
        starts from): drafted where the reply follows it and verified, so greedy output is
        plain decoding's; ``stats.prediction`` counts its tokens that appear in the reply
        and those that do not."""
        m = modes.get(mode) if isinstance(mode, str) else mode
        if options is not None and mode_options:
            raise SpeceeError("pass the mode's options either as options= or as keywords, "
                              "not both")
        opts = options if options is not None else m.options(**mode_options)
        if not isinstance(opts, m.Options):
            raise SpeceeError(f"mode {m.name} takes {m.Options.__name__}, "
                              f"got {type(opts).__name__}")
        if max_tokens < 1:
            raise SpeceeError(f"max_tokens must be positive, got {max_tokens}")
        m.check(self, sampling)
        predicted = self.prediction_tokens(prediction) if prediction is not None else []
        if predicted and (why := m.refuses_prediction()):
            raise SpeceeError(f"prediction: {why}")
        start = m.start(self, sampling, opts)   # fails here, before any decoding
        tokens = self.prompt_tokens(prompt, chat=chat)
        check_fits(len(tokens), max_tokens, self.n_ctx)
        is_eog = (lambda t: False) if ignore_eos else self.model.is_eog
        seq = self.tgt.seq
        seq.reused = 0   # a strategy that does not prefill the target reuses nothing
        steps = start(tokens, max_tokens, prediction=predicted) if predicted \
            else start(tokens, max_tokens)
        return stream(steps, piece=self.model.token_to_piece, is_eog=is_eog,
                      max_tokens=max_tokens, n_prompt=len(tokens), stop=tuple(stop),
                      prediction=predicted if prediction is not None else None,
                      cached=lambda: seq.reused)

    def generate(self, prompt: Prompt, **kw) -> Result:
        """Run :meth:`stream` to the end and return the text, token ids and statistics."""
        done = Transcript()
        for step in self.stream(prompt, **kw):
            done.add(step)
        return done.result()


def load(model: str | Path, draft: str | Path | None = None, **config) -> LLM:
    """Load a registry name or .gguf path (``draft`` likewise); ``config``: LoadConfig fields."""
    return LLM(model, draft=draft, config=LoadConfig(**config))
