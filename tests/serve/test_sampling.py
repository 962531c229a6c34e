"""SamplingParams and the batched sampler (serve/sampling.py): validated parameters, draws that follow the
filtered softmax, noise keyed by (request seed: seed, prompt and occurrence; position; purpose) only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from piecewise_backend.serve import sampling
from piecewise_backend.serve.sampling import SamplingParams

VOCAB = 12
DRAWS = 30_000


def test_sampling_module_does_not_import_transformers():
    code = "import sys, piecewise_backend.serve.sampling as s; s.SamplingParams(0.5); assert 'transformers' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0 \(0: greedy\), got -0.1"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=True), "temperature must be a finite number"),
        (dict(top_k=-1), r"top_k must be an int >= 0 \(0: no top-k\), got -1"),
        (dict(top_k=2.0), "top_k must be an int"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\] \(1.0: no top-p\), got 0.0"),
        (dict(top_p=1.5), "top_p must be a number in"),
        (dict(seed=-1), r"seed must be None or an int in \[0, 2\*\*64\), got -1"),
        (dict(seed="7"), "seed must be None or an int"),
        (dict(temperature=0, top_k=5), r"temperature=0, top_k=5, top_p=1.0\): temperature 0 is greedy"),
        (dict(temperature=0.0, top_p=0.9), "temperature 0 is greedy, which top_k and top_p would not change"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_are_frozen_and_greedy_at_temperature_zero():
    params = SamplingParams(temperature=0)
    assert params.greedy and not SamplingParams().greedy and params.temperature == 0.0
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
    assert hash(SamplingParams(0.5, top_k=3)) == hash(SamplingParams(0.5, top_k=3))
    assert sampling.per_request(None, 2) == [sampling.GREEDY] * 2
    assert sampling.per_request([None, params], 2) == [sampling.GREEDY, params]
    with pytest.raises(ValueError, match="sampling has 1 entries for 2 prompts"):
        sampling.per_request([params], 2)
    with pytest.raises(TypeError, match=r"sampling\[1\] must be a SamplingParams or None, got float"):
        sampling.per_request([params, 0.5], 2)


def _reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution transformers' own warpers give (temperature, then top-k, then top-p)."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    x = warpers.TemperatureLogitsWarper(params.temperature)(None, logits[None].clone())
    if params.top_k:
        x = warpers.TopKLogitsWarper(params.top_k)(None, x)
    if params.top_p < 1:
        x = warpers.TopPLogitsWarper(params.top_p)(None, x)
    return x.softmax(-1)[0]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(0.7, top_k=4), SamplingParams(1.4, top_p=0.75),
     SamplingParams(0.9, top_k=6, top_p=0.6)],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}",
)
def test_draws_follow_the_softmax_of_the_filtered_logits(params):
    """30k draws of one row (each at its own position): chi-square against transformers' warpers, and
    never a token the filters drop."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    keys = [sampling.noise_key(11, position) for position in range(DRAWS)]
    tokens = sampling.sample(logits.expand(DRAWS, VOCAB), [params] * DRAWS, keys)
    freq = torch.bincount(tokens, minlength=VOCAB).double() / DRAWS
    expected = _reference(logits, params).double()
    assert (freq[expected == 0] == 0).all(), (freq, expected)
    kept = expected > 0
    chi2 = (DRAWS * (freq[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < 40, (chi2, freq, expected)  # 11 degrees of freedom at most: p < 1e-4 for a right sampler


def test_noise_depends_on_seed_position_and_purpose_only():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(1.0, seed=3)] * 5
    keys = [sampling.noise_key(3, 10 + row) for row in range(5)]
    batched = sampling.sample(logits, params, keys)
    alone = torch.cat([sampling.sample(logits[i:i + 1], params[i:i + 1], keys[i:i + 1]) for i in range(5)])
    assert torch.equal(batched, alone)  # another row of the step changes nothing
    assert torch.equal(sampling.sample(logits, params, keys), batched)  # the same keys: the same tokens
    flat = torch.zeros(400, 64)  # uniform: the key alone decides, so other keys give other tokens
    draws = [sampling.sample(flat, [params[0]] * 400, [sampling.noise_key(seed, p, purpose) for p in range(400)])
             for seed, purpose in ((3, 0), (4, 0), (3, 1))]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    params = [sampling.GREEDY, SamplingParams(1.0), sampling.GREEDY, SamplingParams(2.0, top_k=1)]
    tokens = sampling.sample(logits, params, [1, 2, 3, 4])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[3] == logits[3].argmax()  # top_k=1 leaves the argmax alone
    with pytest.raises(ValueError, match=r"logits \(4, 32\) need one row per SamplingParams \(3\)"):
        sampling.sample(logits, params[:3], [1, 2, 3])


def test_noise_keys_are_stable_across_processes():
    code = "from piecewise_backend.serve.sampling import noise_key as k; print(k(2**40 + 3, 7), k(1, 2, 3))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout for _ in range(2)}
    assert len(runs) == 1 and len(runs.pop().split()) == 2  # pure integer hashing: no per-process salt


def test_request_seed_hashes_seed_prompt_and_occurrence_stably():
    seeds = {sampling.request_seed(seed, prompt, occurrence)
             for seed in (0, 1, 2**64 - 1) for prompt in ([], [1], [1, 2], [2, 1], [0, 1, 2]) for occurrence in (0, 1)}
    assert len(seeds) == 30 and all(0 <= s < 2**64 for s in seeds)
    assert sampling.request_seed(7, (3, 4)) == sampling.request_seed(7, [3, 4], 0)  # any sequence of ids
    code = "from piecewise_backend.serve.sampling import request_seed as r; print(r(2**40 + 3, [5, 6, 7], 2))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout for _ in range(2)}
    assert runs == {f"{sampling.request_seed(2**40 + 3, [5, 6, 7], 2)}\n"}  # no per-process salt: every rank agrees
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\), got -1"):
        sampling.request_seed(-1, [1])
    with pytest.raises(ValueError, match=r"occurrence must be an int >= 0, got 1.5"):
        sampling.request_seed(1, [1], 1.5)


def test_a_temperature_float32_cannot_divide_by_samples_as_greedy():
    """1e-40 is subnormal and 1e-300 is 0 in float32: logits / t would be +-inf, every positive logit a tie."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    for t in (1e-40, 1e-300, 1e-6):
        params = [SamplingParams(t, seed=1), SamplingParams(t, top_k=1, seed=2)] * 3
        assert params[0].greedy
        assert torch.equal(sampling.sample(logits, params, list(range(6))), logits.argmax(-1))
    assert not SamplingParams(sampling.MIN_TEMPERATURE).greedy


def test_numpy_scalars_are_taken_as_python_numbers():
    import numpy as np

    p = SamplingParams(np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9), seed=np.int64(7))
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 3, 0.9, 7)
    assert type(p.top_k) is int and type(p.seed) is int
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=np.bool_(True))


def test_an_unseeded_request_draws_its_seed_from_torchs_generator():
    torch.manual_seed(5)
    first = sampling.resolve_seed(SamplingParams())
    torch.manual_seed(5)
    assert sampling.resolve_seed(SamplingParams()) == first
    assert sampling.resolve_seed(SamplingParams(seed=9)) == 9
