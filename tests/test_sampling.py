import numpy as np
import pytest

from specee_cpp.config import SamplingConfig
from specee_cpp.engine.sampling import make_sampler, probs
from specee_cpp.errors import SpeceeError

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, 3.0], dtype=np.float32)


def test_greedy_is_argmax_and_one_hot():
    cfg = SamplingConfig()
    assert make_sampler(cfg)(LOGITS) == 4
    assert probs(LOGITS, cfg).tolist() == [0, 0, 0, 0, 1]


def test_temperature_softmax():
    p = probs(LOGITS, SamplingConfig(temperature=2.0))
    ref = np.exp(LOGITS / 2.0) / np.exp(LOGITS / 2.0).sum()
    np.testing.assert_allclose(p, ref, rtol=1e-6)


def test_top_k_and_top_p():
    p = probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert set(np.nonzero(p)[0]) == {0, 4}
    full = probs(LOGITS, SamplingConfig(temperature=1.0))
    p = probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.8))
    # smallest set of most likely tokens reaching 0.8: 4 (0.61) then 0 (0.22)
    assert set(np.nonzero(p)[0]) == {0, 4}
    assert full[4] + full[0] >= 0.8 > full[4]


def test_seeded_sampling_is_reproducible_and_follows_probs():
    cfg = SamplingConfig(temperature=1.0, seed=7)
    s1, s2 = make_sampler(cfg), make_sampler(cfg)
    draws1 = [s1(LOGITS) for _ in range(4000)]
    assert draws1 == [s2(LOGITS) for _ in range(4000)]
    freq = np.bincount(draws1, minlength=5) / 4000
    np.testing.assert_allclose(freq, probs(LOGITS, cfg), atol=0.03)


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_config_rejected_with_value(kw):
    with pytest.raises(SpeceeError, match=str(list(kw.values())[0])):
        SamplingConfig(**kw)
