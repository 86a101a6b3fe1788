"""The Python API: load a target (and optionally a draft) and stream generations."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence as Seq

from ..bindings import Context, Model
from ..config import EEConfig, LoadConfig, SamplingConfig
from ..errors import ContextOverflowError, SpeceeError, TokenizerMismatchError
from ..models.gguf_info import read_gguf_info
from ..models.registry import resolve_model
from .chat_template import ChatTemplate
from .plain import generate_plain
from .sampling import make_sampler
from .sequence import Sequence
from .speculative import generate_spec
from .steps import Stats, Step, stream

Prompt = str | list[dict]
MODES = ("plain", "spec", "ee")
BUNDLE_DIR = Path(__file__).resolve().parent.parent / "bundles"


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    stats: Stats


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """Raise unless draft and target share a vocabulary (read from the GGUF headers)."""
    t, d = read_gguf_info(target), read_gguf_info(draft)
    if t.tokenizer_fingerprint != d.tokenizer_fingerprint:
        raise TokenizerMismatchError(
            f"draft {draft.name} ({d.n_vocab} tokens, tokenizer {d.tokenizer_fingerprint}) does "
            f"not share the tokenizer of target {target.name} ({t.n_vocab} tokens, "
            f"{t.tokenizer_fingerprint})")


class _Loaded:
    """A model with its context and cached sequence."""

    def __init__(self, path: Path, cfg: LoadConfig):
        self.model = Model(path, n_gpu_layers=cfg.n_gpu_layers)
        self.ctx = Context(self.model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                           n_threads=cfg.threads)
        self.seq = Sequence(self.ctx)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class LLM:
    """A target model, an optional draft, and their KV caches.

    The cache is kept between calls: a prompt that extends the previous one (a chat) only
    decodes its new tokens.
    """

    def __init__(self, model: str | Path, draft: str | Path | None = None,
                 config: LoadConfig = LoadConfig()):
        self.config = config
        target_path = resolve_model(model)
        draft_path = resolve_model(draft) if draft is not None else None
        if draft_path is not None:
            check_same_tokenizer(target_path, draft_path)
        self.tgt = _Loaded(target_path, config)
        self.dft = _Loaded(draft_path, config) if draft_path is not None else None
        self._template: ChatTemplate | None = None
        self._bundles: dict[Path, object] = {}   # loaded predictor bundles by path
        self._target_sha: str | None = None      # hashed on first early-exit use
        self._draft_sha: str | None = None       # hashed on first controller/cost use
        self._costs = None                       # measured/cached on first use
        self._controller = None
        self.controller_file: str | None = None  # overrides the shipped controller

    @property
    def model(self) -> Model:
        return self.tgt.model

    def close(self) -> None:
        for loaded in (self.tgt, self.dft):
            if loaded is not None:
                loaded.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the cached conversation: the next prompt is decoded from scratch."""
        for loaded in (self.tgt, self.dft):
            if loaded is not None:
                loaded.seq.rewind(0)

    def prompt_text(self, prompt: Prompt) -> str:
        """The chat template rendered for a user message or a list of {role, content}."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self._template is None:
            self._template = ChatTemplate(self.model)
        return self._template.render(messages)

    def prompt_tokens(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (chat template applied unless ``chat`` is False)
        or a list of {role, content} messages."""
        if isinstance(prompt, str) and not chat:
            return self.model.tokenize(prompt, add_special=True, parse_special=False)
        # The template writes BOS itself where the model wants one.
        return self.model.tokenize(self.prompt_text(prompt), add_special=False,
                                   parse_special=True)

    def target_sha256(self) -> str:
        """sha256 of the target GGUF (from pull's stamp when possible), computed once."""
        from ..models.pull import file_sha256

        if self._target_sha is None:
            self._target_sha = file_sha256(self.model.path)
        return self._target_sha

    def draft_sha256(self) -> str:
        """sha256 of the draft GGUF, computed once (keys the cost model and the controller)."""
        from ..models.pull import file_sha256

        if self.dft is None:
            raise SpeceeError("no draft model loaded (--draft)")
        if self._draft_sha is None:
            self._draft_sha = file_sha256(self.dft.model.path)
        return self._draft_sha

    def bundle_path(self, provider: str) -> Path:
        """Where the shipped (or default calibrated) exit predictors for this target live."""
        return BUNDLE_DIR / f"{self.target_sha256()[:16]}.{provider}.npz"

    def candidates(self, provider: str, k: int):
        """A fresh candidate provider of this LLM: ``draft`` (needs a draft) or ``ngram``."""
        from ..ee.candidates import DraftCandidates, NgramCandidates

        if provider == "draft":
            if self.dft is None:
                raise SpeceeError("the draft provider needs a draft model (--draft)")
            return DraftCandidates(self.dft.seq, k=k)
        if provider == "ngram":
            return NgramCandidates(k=k)
        raise SpeceeError(f"unknown candidate provider {provider!r}; use draft or ngram")

    def predictors(self, ee: EEConfig):
        """The exit predictors for this target and provider (checked against the target)."""
        from ..ee.predictor import Predictors

        sha = self.target_sha256()
        path = Path(ee.predictors) if ee.predictors else self.bundle_path(ee.provider)
        if path not in self._bundles:
            if not ee.predictors and not path.is_file():
                raise SpeceeError(
                    f"no shipped exit predictors for {self.model.path.name} with the "
                    f"{ee.provider} provider; run specee-cpp calibrate and pass --predictors")
            pred = Predictors.load(path)
            pred.check_target(sha, self.model.n_layer, self.model.path)
            if pred.k != ee.k:
                raise SpeceeError(f"predictor bundle {path.name} uses k={pred.k}, not k={ee.k}")
            self._bundles[path] = pred
        return self._bundles[path]

    def _ee_steps(self, tokens: list[int], sampling: SamplingConfig, ee: EEConfig):
        from ..ee.decode import generate_ee
        from ..ee.scheduler import Scheduler

        if not sampling.greedy:
            raise SpeceeError("mode ee decodes greedily (early exit changes the distribution); "
                              f"got temperature {sampling.temperature}")
        provider = self.candidates(ee.provider, ee.k)
        pred = self.predictors(ee)
        if pred.meta.get("provider") != ee.provider:
            raise SpeceeError(f"predictor bundle was fitted with the {pred.meta.get('provider')} "
                              f"provider, not {ee.provider}")
        rates = {int(k): v for k, v in pred.meta.get("exit_rate", {}).items()}
        sched = Scheduler(n_layer=self.model.n_layer, offline=pred.meta.get("offline", pred.layers),
                          allowed=set(pred.layers), exit_rate=rates,
                          layer_cost=pred.meta.get("layer_cost_s", 0.0),
                          probe_cost=pred.meta.get("probe_cost_s", 0.0))
        threshold = pred.threshold if ee.threshold is None else ee.threshold
        return generate_ee(self.tgt.seq, tokens, provider, pred, sched, threshold, rule=ee.rule)

    def cost_model(self):
        """This machine's speculative cost model for the loaded pair (measured on first use
        in ~10 s, then cached under ``$SPECEE_CPP_HOME/costs``)."""
        from .cost import MEASURE_VERSION, load_or_measure, measure

        if self.dft is None:
            raise SpeceeError("a cost model needs a draft model (--draft)")
        if self._costs is None:
            from ..provenance import machine, machine_id

            # the machine (CPU features, build, threads, AMX switch) is part of the key: a
            # cache copied to another machine, or a rebuilt library, measures again
            where = machine(self.config.threads)
            key = (f"{self.target_sha256()[:12]}-{self.draft_sha256()[:12]}"
                   f"-m{machine_id(where)}-v{MEASURE_VERSION}")
            prompt = self.prompt_tokens("Write a function that parses a date and explain it.")
            self._costs = load_or_measure(
                key, lambda: replace(measure(self.tgt.seq, self.dft.seq, prompt), machine=where))
        return self._costs

    def controller_path(self) -> Path:
        """The shipped acceptance model for this draft (any quantization of its target)."""
        return BUNDLE_DIR / f"controller-{self.draft_sha256()[:16]}.npz"

    def controller(self):
        """The fitted acceptance model (``controller`` path given at load, else shipped),
        refused for a target of another shape than it was fitted on."""
        from ..controller.acceptance import AcceptanceModel

        if self._controller is None:
            path = Path(self.controller_file) if self.controller_file else self.controller_path()
            if not self.controller_file and not path.is_file():
                raise SpeceeError(f"no shipped draft-length controller for draft "
                                  f"{self.dft.model.path.name}; pass a fixed --gamma N or fit "
                                  f"one with specee-cpp fit-controller")
            model = AcceptanceModel.load(path)
            shape = [self.model.info.arch, self.model.n_layer, self.model.n_embd]
            if model.meta.get("target_shape", shape) != shape:
                raise SpeceeError(f"controller {path.name} was fitted for a target of shape "
                                  f"{model.meta['target_shape']}, not {shape}")
            self._controller = model
        return self._controller

    def draft_policy(self, gamma: int | str):
        """A fresh draft-length policy: a number (fixed gamma, 0 is plain decoding), auto
        (ours, cost-aware gamma), stop (ours, cost-aware per-token stop), pmin (llama.cpp's
        p_min 0.75 / max 8), hf (HF's heuristic) or speckv (SpecKV's objective)."""
        from ..controller.policies import make_policy

        name = str(gamma).strip().lower()
        if name.isdigit() and not 0 <= int(name) < self.config.n_batch:
            raise SpeceeError(f"gamma must be in [0, {self.config.n_batch}), got {gamma}")
        needs_model = name in ("auto", "stop", "speckv")
        return make_policy(name, model=self.controller() if needs_model else None,
                           costs=self.cost_model() if name in ("auto", "stop") else None,
                           bpw=self.model.bits_per_weight)

    def stream(self, prompt: Prompt, *, max_tokens: int = 256,
               sampling: SamplingConfig = SamplingConfig(), stop: Seq[str] = (),
               chat: bool = True, mode: str = "plain", ee: EEConfig = EEConfig(),
               gamma: int | str = "auto") -> Iterator[Step]:
        """Generate from ``prompt``, yielding one :class:`Step` per token; the last step
        carries ``finish_reason`` and ``stats``. ``gamma`` (mode spec): tokens drafted per
        round, or a policy name (auto, stop, pmin, hf, speckv; see :meth:`draft_policy`)."""
        if mode not in MODES:
            raise SpeceeError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        if max_tokens < 1:
            raise SpeceeError(f"max_tokens must be positive, got {max_tokens}")
        policy = None
        if mode == "spec":
            if self.dft is None:
                raise SpeceeError("mode spec needs a draft model (--draft)")
            policy = self.draft_policy(gamma)
        tokens = self.prompt_tokens(prompt, chat=chat)
        if len(tokens) + max_tokens > self.tgt.ctx.n_ctx:
            raise ContextOverflowError(
                f"prompt of {len(tokens)} tokens + max_tokens {max_tokens} exceed the context "
                f"of {self.tgt.ctx.n_ctx}; use a larger --n-ctx or fewer tokens")
        if mode == "ee":
            steps = self._ee_steps(tokens, sampling, ee)
        elif mode == "spec" and not policy.plan_is_plain:
            steps = generate_spec(self.tgt.seq, self.dft.seq, tokens, policy, sampling)
        else:
            steps = generate_plain(self.tgt.seq, tokens, make_sampler(sampling))
        return stream(steps, piece=self.model.token_to_piece, is_eog=self.model.is_eog,
                      max_tokens=max_tokens, n_prompt=len(tokens), stop=tuple(stop))

    def generate(self, prompt: Prompt, **kw) -> Result:
        """Run :meth:`stream` to the end and return the text, token ids and statistics."""
        text, toks, stats = [], [], None
        for step in self.stream(prompt, **kw):
            text.append(step.text)
            if step.finish_reason != "stop":
                toks.append(step.token)
            stats = step.stats or stats
        return Result(text="".join(text), tokens=toks, stats=stats)


def load(model: str | Path, draft: str | Path | None = None, **config) -> LLM:
    """Load a registry name or .gguf path (``draft`` likewise); ``config``: LoadConfig fields."""
    return LLM(model, draft=draft, config=LoadConfig(**config))
