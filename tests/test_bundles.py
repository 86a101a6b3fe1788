"""The shipped bundles and their list (specee_cpp/bundles/README.md) agree, and each file is
named for a model the registry knows (or, for a head ranking, a tokenizer)."""
import re

from specee_cpp.models.registry import load_registry
from specee_cpp.paths import BUNDLE_DIR


def listed() -> set[str]:
    text = (BUNDLE_DIR / "README.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `([^`]+)` \|", text, re.M))


def test_every_bundle_is_listed_and_every_listed_one_is_shipped():
    shipped = {p.name for p in BUNDLE_DIR.iterdir() if p.name not in (".keep", "README.md")}
    assert shipped == listed()


def test_bundles_are_named_for_registry_models():
    prefixes = {m.sha256[:16] for m in load_registry().models.values()}
    for name in listed():
        if name.endswith(".head-ranking.npz"):
            continue   # named for a tokenizer fingerprint
        digest = re.search(r"[0-9a-f]{16}", name).group(0)
        assert digest in prefixes, name
