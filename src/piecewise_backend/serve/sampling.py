"""Sampling parameters per request, and one batched sampler for a whole step.

:class:`SamplingParams` is plain data (no transformers import; ``piecewise_backend.serve`` and
``piecewise_backend.hf`` export it). :func:`sample` draws one token per row of a step's logits with the Gumbel-max trick: the
token is ``argmax(logits / temperature + g)`` over the tokens top-k and top-p keep, where ``g`` is
Gumbel noise, which picks each token with exactly its softmax probability. The noise is not drawn
from a generator's state but computed from a counter-based hash of ``(request seed, position,
purpose, token id)``, where the request seed (:func:`request_seed`) hashes the seed with the
request's prompt (and which occurrence of that prompt it is within one ``generate`` call), so
requests sharing a seed draw independent noise: a request's token at a position gets the same
noise whatever else runs in the step, at any batch index, under any request id, in every graph
mode, on every run, and again after a preemption recomputes the request (vLLM's per-request
seed). ``purpose`` keeps draws apart that share a position (speculative decoding's draft, accept
and resample draws). Every
row's parameters go to the device as one small tensor each, so the step costs no per-request host
round trip; the caller reads the sampled ids back once per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..runner.agreement import distributed
from ..validation import is_int as _is_int

_M32 = 0xFFFFFFFF
_MAX_SEED = 2**64


def _is_real(value: object) -> bool:  # numpy's float and integer scalars count (numbers.Real)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens: ``temperature`` 0 is greedy (argmax).

    ``top_k`` keeps the k most likely tokens (0: all), ``top_p`` the smallest set of most likely
    tokens whose probability reaches it (1.0: all), both after ``temperature``; ``seed`` makes the
    tokens reproducible: with a seed, a request's tokens depend only on its prompt, these
    parameters and the seed, not on its batch index, its request id, the other requests or how
    the steps were scheduled (None: a seed drawn from torch's default generator when the request
    starts, so ``torch.manual_seed`` reproduces them too). The noise is keyed by the seed and the
    prompt together (:func:`request_seed`), so requests sharing a seed are not correlated; identical
    prompts in one ``generate`` call are told apart by their order among themselves. A temperature below
    :data:`MIN_TEMPERATURE` samples as greedy: dividing by it in float32 would overflow the logits,
    and it leaves only the largest logit a chance anyway.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if not _is_int(k) or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0: no top-k), got {k!r}")
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1.0: no top-p), got {p!r}")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < _MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {seed!r}")
        if t == 0 and (k != 0 or p != 1):
            raise ValueError(
                f"SamplingParams(temperature=0, top_k={k}, top_p={p}): temperature 0 is greedy, which top_k and "
                "top_p would not change; use a temperature > 0 to sample, or drop top_k/top_p for greedy"
            )
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        if seed is not None:
            object.__setattr__(self, "seed", int(seed))

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one below :data:`MIN_TEMPERATURE`."""
        return self.temperature < MIN_TEMPERATURE


#: Temperatures below this sample as greedy (argmax): ``logits / temperature`` in float32 would
#: overflow to inf (1e-40 is subnormal, 1e-300 is 0), making every positive logit a tie.
MIN_TEMPERATURE = 1e-5


#: What ``sampling=None`` means.
GREEDY = SamplingParams(temperature=0.0)


def per_request(sampling: SamplingParams | Sequence[SamplingParams | None] | None, count: int) -> list[SamplingParams]:
    """``sampling`` as one :class:`SamplingParams` per request (None: greedy), or a clear error."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or GREEDY] * count
    if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
        raise TypeError(f"sampling must be None, a SamplingParams or one per prompt, got {type(sampling).__name__}")
    if len(sampling) != count:
        raise ValueError(f"sampling has {len(sampling)} entries for {count} prompts; give one per prompt or one for all")
    bad = next((i for i, s in enumerate(sampling) if s is not None and not isinstance(s, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling[{bad}] must be a SamplingParams or None, got {type(sampling[bad]).__name__}")
    return [s or GREEDY for s in sampling]


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or one drawn from torch's default generator.

    In a process group (tensor parallel: every rank runs the same requests) rank 0's draw is broadcast,
    so every rank samples the same tokens whatever its own generator's state.
    """
    if params.seed is not None:
        return params.seed
    seed = torch.randint(0, 2**62, (), dtype=torch.long)  # a CPU tensor: no device sync
    if distributed():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        seed = seed.to(device)
        dist.broadcast(seed, 0)
    return int(seed.item())


def request_seed(seed: int, prompt: Sequence[int], occurrence: int = 0) -> int:
    """The 64-bit seed a request's noise is keyed by: a blake2b hash of ``seed``, its prompt's token ids
    and ``occurrence`` (which copy of an identical prompt it is within one ``generate`` call, 0 first).

    Never the batch index or request id, so a request reproduces alone and in any batch; the prompt
    keeps requests that share ``seed`` apart (without it, a prompt extended by the other's first
    token would get the other's tokens shifted by one position). Stable across processes and ranks.
    """
    if not _is_int(seed) or not 0 <= seed < _MAX_SEED:
        raise ValueError(f"request_seed: seed must be an int in [0, 2**64), got {seed!r}")
    if not _is_int(occurrence) or occurrence < 0:
        raise ValueError(f"request_seed: occurrence must be an int >= 0, got {occurrence!r}")
    ids = [int(t) for t in prompt]
    digest = hashlib.blake2b(digest_size=8, person=b"pb-request-seed")
    digest.update(struct.pack("<QQQ", int(seed), int(occurrence), len(ids)))
    digest.update(struct.pack(f"<{len(ids)}q", *ids))
    return int.from_bytes(digest.digest(), "little")


def _mix(x: int) -> int:
    """A 32-bit integer hash (Wellons' lowbias32) of a Python int < 2**32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_key(seed: int, position: int, purpose: int = 0) -> int:
    """The 32-bit key of the noise a request's token at ``position`` is sampled with (``purpose``:
    which draw at that position, 0 for the token itself)."""
    h = _mix(position & _M32)
    for part in (purpose & _M32, seed & _M32, seed >> 32):
        h = _mix(h ^ part)
    return h


def _mul(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` < 2**32 without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` elementwise on an int64 tensor of values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``(rows, vocab)`` from each row's 32-bit key (float32)."""
    columns = _mix_tensor(torch.arange(vocab, dtype=torch.long, device=keys.device) + 0x9E3779B9 & _M32)
    h = _mix_tensor(_mix_tensor(keys[:, None] ^ columns[None, :]) ^ keys[:, None])
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24  # 24 random bits: uniform in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` with every token outside top-k and then top-p set to -inf (float32).

    Rows are independent: ``top_k`` 0 and ``top_p`` 1.0 keep every token of their row. Ties at the
    k-th logit are kept (as transformers' top-k warper keeps them); top-p keeps each token whose more
    likely tokens sum to less than ``top_p``, so the token that reaches it is kept too.
    """
    scaled = logits.float() / temperature[:, None]
    if not bool((top_k > 0).any()) and not bool((top_p < 1).any()):  # host-side tensors: no device read
        return scaled
    vocab = scaled.shape[-1]
    device = scaled.device
    top_k, top_p = top_k.to(device), top_p.to(device)
    ordered, order = scaled.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    keep_sorted = (before < top_p[:, None]) & (ordered > float("-inf"))
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int]) -> torch.Tensor:
    """One token id per row of ``logits`` ``(rows, vocab)``: argmax for greedy rows, else a draw
    from the row's filtered softmax with the noise of ``keys[row]`` (see :func:`noise_key`).

    Returns a device tensor of ``rows`` ids; nothing is read back to the host here.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(keys):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} need one row per SamplingParams ({len(params)}) and per key ({len(keys)})"
        )
    greedy = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy
    masked, is_greedy = _filtered(logits, params)
    noise = gumbel_noise(torch.tensor(list(keys), dtype=torch.long).to(logits.device), logits.shape[-1])
    return torch.where(is_greedy, greedy, (masked + noise).argmax(-1))


def _filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's filtered logits under its params (:func:`filtered_logits`; greedy rows at temperature 1),
    and which rows are greedy (a device bool tensor)."""
    device = logits.device
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    masked = filtered_logits(logits, temperature.to(device), top_k, top_p)
    return masked, torch.tensor([p.greedy for p in params]).to(device)


#: The token id a step reports for a request whose logits hold a NaN (argmax would pick the NaN's
#: index): the serving loop ends that request with ``finish_reason="error"``.
NAN_TOKEN = -1


def mark_nan(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` (one per row of ``logits`` ``(rows, vocab)``, on its device; written in place) with
    :data:`NAN_TOKEN` where the row holds a NaN (or both infinities: no distribution either); on the
    device, so the step's one read-back of the tokens carries it."""
    # A row's sum is NaN exactly then (a finite overflow gives an infinity): 3 ops, not isnan/any/where's 4
    # (each costs microseconds of host time in every decode step).
    return tokens.masked_fill_(logits.sum(-1).isnan(), NAN_TOKEN)


#: ``noise_key`` purposes: a request's token itself (plain decoding, and speculative decoding's bonus
#: token), a drafter's proposal, the acceptance test of a draft, and the draw after a rejection.
TOKEN, DRAFT, ACCEPT, RESAMPLE = 0, 1, 2, 3


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row of ``logits`` ``(rows, vocab)`` samples from under its params: the
    softmax of its filtered logits (float32), one-hot at the argmax for a greedy row."""
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    if all(p.greedy for p in params):
        return greedy
    masked, is_greedy = _filtered(logits, params)
    return torch.where(is_greedy[:, None], greedy, masked.softmax(-1))


def sample_from(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``(rows, vocab)`` (unnormalized is fine; zeros are never drawn), with
    the Gumbel noise of each row's key (a device tensor of 32-bit keys)."""
    return (probs.log() + gumbel_noise(keys, probs.shape[-1])).argmax(-1)


def uniform_noise(keys: torch.Tensor) -> torch.Tensor:
    """One uniform draw in (0, 1) per key (float32), from the same hash as :func:`gumbel_noise`."""
    h = _mix_tensor(_mix_tensor(keys ^ 0x85EBCA6B) ^ keys)
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24
