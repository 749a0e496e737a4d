"""engine.sampler.Sampler: greedy, temperature, top-k / top-p / min-p, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import llmserve.engine.step.sampler as sampler_module
from llmserve.common.sampling import SamplingError
from llmserve.engine.step import sampler as engine_sampler
from llmserve.engine.step.sampler import seed_for, seeded_exponential
from llmserve.protos.common_pb2 import SamplingParams
from tests.factories import sampling

CPU = torch.device("cpu")
NUM_DRAWS = 20_000


class Sampler(engine_sampler.Sampler):
    """The engine's sampler, called for the two results most tests look at."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
        output_token_ids: Sequence[list[int]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n, vocab] float32 -> (token ids [n] int64, chosen-token logprobs [n] or None).
        The two results most callers need; `sample` has the rest."""
        out = self.sample(logits, params, output_indices, output_token_ids)
        return out.token_ids, out.logprobs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draw_counts(
    logits: torch.Tensor, params: SamplingParams, num_draws: int = NUM_DRAWS, seed: int = 0
) -> torch.Tensor:
    """Counts per token of num_draws independent draws from one row of logits (batched: one
    sampler call over num_draws identical rows, each with its own noise)."""
    sampler = Sampler(CPU, seed)
    batch = logits[None, :].expand(num_draws, -1).contiguous()
    tokens, _ = sampler(batch, [params] * num_draws, [0] * num_draws)
    return torch.bincount(tokens, minlength=logits.shape[0])


def assert_frequencies(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Each token's count within 5 standard deviations of the binomial mean; tokens with zero
    probability never drawn."""
    n = int(counts.sum())
    expected = probs.double() * n
    sd = (n * probs.double() * (1 - probs.double())).sqrt()
    zero = probs == 0
    assert counts[zero].sum() == 0, f"masked tokens drawn: {counts.tolist()} vs {probs.tolist()}"
    excess = (counts.double() - expected).abs() - 5 * sd - 1
    assert bool((excess <= 0).all()), f"counts {counts.tolist()} vs expected {expected.tolist()}"


def filtered_probs(logits: torch.Tensor, keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    scaled = logits.double() / temperature
    mask = torch.full_like(scaled, float("-inf"))
    mask[keep] = 0.0
    return torch.softmax(scaled + mask, dim=-1)


# A small vocabulary with known, distinct probabilities (sorted order 3, 0, 5, 1, 4, 2, 6, 7).
LOGITS = torch.log(torch.tensor([0.20, 0.10, 0.05, 0.30, 0.07, 0.15, 0.08, 0.05]))


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    tokens, logprobs = Sampler(CPU)(logits, [sampling(temperature=0.0)] * 16, [0] * 16)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert logprobs is None


def test_top_k_one_is_greedy_even_with_temperature() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    params = [sampling(temperature=5.0, top_k=1)] * 64
    tokens, _ = Sampler(CPU)(logits, params, [0] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_sampled_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(40, 30)
    params = [
        sampling(temperature=0.0) if i % 2 else sampling(temperature=2.0, top_p=0.5)
        for i in range(40)
    ]
    tokens, _ = Sampler(CPU)(logits, params, [0] * 40)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-6])
def test_tiny_positive_temperature_is_greedy(temperature: float) -> None:
    """logits / 1e-38 overflows to inf and the softmax to NaN, whose draw is token 0 every
    time; below common.sampling.MIN_TEMPERATURE the row is sampled as greedy instead, seeded
    or not, alone or beside sampled rows."""
    torch.manual_seed(3)
    logits = torch.randn(32, 500)
    assert bool((logits.argmax(dim=-1) != 0).all())
    params = [
        sampling(temperature=temperature, seed=i) if i % 2 else sampling(temperature=temperature)
        for i in range(31)
    ] + [sampling(temperature=1.0)]
    tokens, _ = Sampler(CPU)(logits, params, [0] * 32)
    assert params[0].temperature > 0  # still positive as float32 (1e-38 is subnormal)
    assert torch.equal(tokens[:31], logits[:31].argmax(dim=-1))


# ---- temperature -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    counts = draw_counts(LOGITS, sampling(temperature=temperature))
    assert_frequencies(counts, torch.softmax(LOGITS.double() / temperature, dim=-1))


def test_low_temperature_concentrates() -> None:
    counts = draw_counts(LOGITS, sampling(temperature=0.05), num_draws=2000)
    # p(second) / p(first) = (0.2 / 0.3) ** 20 ~ 3e-4
    assert counts[3] >= 1990


# ---- filters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_k", "keep"),
    [(1, [3]), (2, [3, 0]), (3, [3, 0, 5]), (5, [3, 0, 5, 1, 6]), (8, list(range(8)))],
)
def test_top_k_keeps_exactly_the_k_most_likely(top_k: int, keep: list[int]) -> None:
    counts = draw_counts(LOGITS, sampling(top_k=top_k))
    assert_frequencies(counts, filtered_probs(LOGITS, keep))


def test_top_k_larger_than_vocab_keeps_all() -> None:
    counts = draw_counts(LOGITS, sampling(top_k=100))
    assert_frequencies(counts, torch.softmax(LOGITS.double(), dim=-1))


@pytest.mark.parametrize(
    ("top_p", "keep"),
    [
        # sorted probs: 0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.05, 0.05
        # cumulative:   0.30, 0.50, 0.65, 0.75, 0.83, 0.90, 0.95, 1.00
        (0.1, [3]),
        (0.29, [3]),
        (0.31, [3, 0]),
        (0.6, [3, 0, 5]),
        (0.7, [3, 0, 5, 1]),
        (0.8, [3, 0, 5, 1, 6]),
        (0.86, [3, 0, 5, 1, 6, 4]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, keep: list[int]) -> None:
    counts = draw_counts(LOGITS, sampling(top_p=top_p))
    assert_frequencies(counts, filtered_probs(LOGITS, keep))


@pytest.mark.parametrize(
    ("min_p", "keep"),
    [
        (0.9, [3]),  # threshold 0.27
        (0.6, [3, 0]),  # 0.18: 0.20 kept, 0.15 dropped
        (0.49, [3, 0, 5]),  # 0.147: 0.15 kept
        (0.51, [3, 0]),  # 0.153: 0.15 dropped
        (0.3, [3, 0, 5, 1]),  # 0.09
        (0.2, [3, 0, 5, 1, 6, 4]),  # 0.06
        (0.1, list(range(8))),
    ],
)
def test_min_p_drops_tokens_below_fraction_of_top(min_p: float, keep: list[int]) -> None:
    counts = draw_counts(LOGITS, sampling(min_p=min_p))
    assert_frequencies(counts, filtered_probs(LOGITS, keep))


def test_top_k_then_top_p_over_what_top_k_kept() -> None:
    # top_k=4 keeps 0.30, 0.20, 0.15, 0.10 -> renormalized 0.40, 0.267, 0.20, 0.133
    # top_p=0.6: 0.40 < 0.6, 0.667 reaches it -> keep two
    counts = draw_counts(LOGITS, sampling(top_k=4, top_p=0.6))
    assert_frequencies(counts, filtered_probs(LOGITS, [3, 0]))


def test_temperature_then_top_p() -> None:
    # T=0.5 squares the probabilities: 0.09, 0.04, 0.0225, 0.01, ... of sum 0.1788 ->
    # 0.503, 0.224, 0.126, ...; top_p=0.7 keeps 2 (0.503 + 0.224 = 0.727 reaches 0.7), where at
    # T=1 it would keep 4 (0.30 + 0.20 + 0.15 = 0.65 < 0.7)
    counts = draw_counts(LOGITS, sampling(temperature=0.5, top_p=0.7))
    assert_frequencies(counts, filtered_probs(LOGITS, [3, 0], temperature=0.5))


def test_all_filters_combined() -> None:
    # top_k=6 -> {3,0,5,1,6,4}; top_p=0.9 of renormalized (sum 0.90): 0.333, 0.556, 0.722,
    # 0.833, 0.922 -> keep 5; min_p=0.3 of 0.30 = 0.09 drops 6 (0.08) -> {3, 0, 5, 1}
    counts = draw_counts(LOGITS, sampling(top_k=6, top_p=0.9, min_p=0.3))
    assert_frequencies(counts, filtered_probs(LOGITS, [3, 0, 5, 1]))


@pytest.mark.parametrize(
    "params",
    [
        sampling(top_p=1e-9),
        SamplingParams(temperature=1.0, top_p=0.0),  # out of range: the sampler copes
        sampling(min_p=1.0),
        sampling(top_k=1, top_p=1e-9, min_p=1.0),
        sampling(temperature=1e-3, top_p=1e-6),
    ],
)
def test_most_likely_token_always_survives(params: SamplingParams) -> None:
    torch.manual_seed(3)
    logits = torch.randn(200, 64)
    tokens, _ = Sampler(CPU)(logits, [params] * 200, [0] * 200)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_filters_are_per_row() -> None:
    """A row without filters keeps its full distribution when its batch-mate filters."""
    n = NUM_DRAWS
    batch = LOGITS[None, :].expand(2 * n, -1).contiguous()
    params = [sampling(top_k=1, temperature=0.7), sampling()] * n
    tokens, _ = Sampler(CPU, 5)(batch, params, [0] * (2 * n))
    assert bool((tokens[0::2] == 3).all())
    assert_frequencies(torch.bincount(tokens[1::2], minlength=8), torch.softmax(LOGITS, dim=-1))


def test_unfiltered_row_keeps_every_token_on_a_large_vocab() -> None:
    """A row with top_p=1.0 (and no other filter) must drop nothing when a batch-mate's filter
    sends the batch through _filter, even where float32 cumulative sums round above 1."""
    torch.manual_seed(4)
    vocab = 50_000
    logits = torch.randn(4, vocab) * 3
    params = [sampling(top_k=5), sampling(), sampling(), sampling()]
    scaled = Sampler._filter(logits.clone(), params)
    assert int(torch.isinf(scaled[0]).sum()) == vocab - 5
    dropped = torch.isinf(scaled[1:]).sum(dim=-1).tolist()
    assert dropped == [0, 0, 0], f"rows with top_p=1.0 lost {dropped} tokens"
    assert torch.equal(scaled[1:], logits[1:])


# ---- seeds -----------------------------------------------------------------------------------


def test_seed_for_is_deterministic_and_spread() -> None:
    assert seed_for(7, 3) == seed_for(7, 3)
    values = {seed_for(s, i) for s in range(20) for i in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_seeded_row_independent_of_batch_mates_and_position() -> None:
    torch.manual_seed(5)
    vocab = 100
    mine = torch.randn(vocab)
    params = sampling(temperature=1.5, top_p=0.95, seed=1234)
    alone, _ = Sampler(CPU, 0)(mine[None], [params], [7])

    others = torch.randn(6, vocab)
    for pos in range(7):
        batch = torch.cat([others[:pos], mine[None], others[pos:]])
        other_params = [sampling(temperature=1.0, seed=i) for i in range(6)]
        plist = [*other_params[:pos], params, *other_params[pos:]]
        indices = [0] * pos + [7] + [3] * (6 - pos)
        # a fresh sampler with another engine seed: seeded rows must not care
        tokens, _ = Sampler(CPU, 99 + pos)(batch, plist, indices)
        assert int(tokens[pos]) == int(alone[0])


def test_seeded_rows_reproduce_a_distribution() -> None:
    """Over many seeds, seeded draws still follow softmax(logits / T)."""
    n = NUM_DRAWS
    batch = LOGITS[None, :].expand(n, -1).contiguous()
    params = [sampling(temperature=1.0, seed=s) for s in range(n)]
    tokens, _ = Sampler(CPU)(batch, params, [0] * n)
    assert_frequencies(torch.bincount(tokens, minlength=8), torch.softmax(LOGITS, dim=-1))


def test_same_seed_different_output_index_gives_different_draws() -> None:
    vocab = 1000
    logits = torch.zeros(1, vocab)  # uniform: draws are the noise's argmax
    params = [sampling(temperature=1.0, seed=42)]
    draws = [int(Sampler(CPU)(logits, params, [i])[0][0]) for i in range(20)]
    assert len(set(draws)) >= 18
    again = [int(Sampler(CPU, 7)(logits, params, [i])[0][0]) for i in range(20)]
    assert draws == again


def test_different_seeds_give_different_draws() -> None:
    logits = torch.zeros(1, 1000)
    draws = {int(Sampler(CPU)(logits, [sampling(seed=s)], [0])[0][0]) for s in range(20)}
    assert len(draws) >= 18


def test_unseeded_rows_use_the_engine_generator() -> None:
    torch.manual_seed(6)
    logits = torch.randn(32, 500)
    params = [sampling(temperature=1.0)] * 32

    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(CPU, seed)
        return [sampler(logits, params, [0] * 32)[0].tolist() for _ in range(3)]

    first = run(11)
    assert run(11) == first  # same engine seed -> same sequence of draws
    assert first[0] != first[1]  # the generator advances between calls
    assert run(12) != first
    # the global torch RNG plays no part
    torch.manual_seed(123)
    a = Sampler(CPU, 11)(logits, params, [0] * 32)[0]
    torch.manual_seed(456)
    b = Sampler(CPU, 11)(logits, params, [0] * 32)[0]
    assert torch.equal(a, b)


def test_seeded_row_does_not_depend_on_engine_generator_state() -> None:
    logits = torch.zeros(1, 1000)
    params = [sampling(seed=3)]
    sampler = Sampler(CPU, 0)
    first = int(sampler(logits, params, [5])[0][0])
    for _ in range(3):
        sampler(logits.expand(4, -1), [sampling()] * 4, [0] * 4)
    assert int(sampler(logits, params, [5])[0][0]) == first


def test_one_seed_follows_the_distribution_over_its_outputs() -> None:
    """A single seeded request's successive draws (output indices 0, 1, 2, ...) follow
    softmax(logits / T): the use that matters, one seed and many positions."""
    n = NUM_DRAWS
    batch = LOGITS[None, :].expand(n, -1).contiguous()
    params = [sampling(temperature=0.8, seed=77)] * n
    tokens, _ = Sampler(CPU)(batch, params, list(range(n)))
    assert_frequencies(torch.bincount(tokens, minlength=8), torch.softmax(LOGITS / 0.8, dim=-1))


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (sampling(top_k=3), [3, 0, 5]),
        (sampling(top_p=0.6), [3, 0, 5]),
        (sampling(min_p=0.3), [3, 0, 5, 1]),
        (sampling(top_k=6, top_p=0.9, min_p=0.3), [3, 0, 5, 1]),
    ],
)
def test_seeded_rows_respect_the_filters(params: SamplingParams, keep: list[int]) -> None:
    n = NUM_DRAWS
    batch = LOGITS[None, :].expand(n, -1).contiguous()
    seeded = [
        sampling(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=s)
        for s in range(n)
    ]
    tokens, _ = Sampler(CPU)(batch, seeded, [3] * n)
    assert_frequencies(torch.bincount(tokens, minlength=8), filtered_probs(LOGITS, keep))


def test_seeded_noise_is_exponential() -> None:
    """seeded_exponential: each row is Exponential(1): mean 1, and P(E > t) = exp(-t) at several
    t within 5 standard deviations; the 32-bit hashes behind it are uniform over 64 bins
    (chi-square, 63 degrees of freedom, far below its 1e-6 tail of ~123)."""
    keys = torch.tensor([seed_for(s, i) for s in range(8) for i in range(4)])
    noise = seeded_exponential(keys, 4096).double()
    assert noise.shape == (32, 4096) and bool((noise > 0).all())
    n = noise.numel()
    assert abs(float(noise.mean()) - 1.0) < 5 / math.sqrt(n)
    for t in (0.01, 0.1, 0.5, 1.0, 2.0, 4.0):
        p = math.exp(-t)
        frac = float((noise > t).double().mean())
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / n), t
    u = torch.exp(-noise)  # back to (0, 1)
    counts = torch.bincount((u * 64).long().clamp(max=63).flatten(), minlength=64).double()
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 123, chi2


def test_seeded_noise_rows_are_not_correlated() -> None:
    """Neighbouring output indices of one seed, and neighbouring seeds, give unrelated rows."""
    keys = torch.tensor([seed_for(5, 0), seed_for(5, 1), seed_for(6, 0)])
    noise = seeded_exponential(keys, 20_000).double()
    corr = torch.corrcoef(noise)
    off_diagonal = corr[~torch.eye(3, dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < 5 / math.sqrt(20_000)
    # and within a row, neighbouring columns
    row = noise[0]
    assert abs(float(torch.corrcoef(torch.stack([row[:-1], row[1:]]))[0, 1])) < 0.04


def test_seeded_noise_is_pinned() -> None:
    """The noise function is part of the seed contract (the same seed gives the same text
    across versions): a change to it must be deliberate."""
    keys = torch.tensor([seed_for(1234, 0), seed_for(0, 0)])
    expected = [
        [1.62456214427948, 1.1319459676742554, 0.03730154037475586, 0.5820446014404297],
        [0.561737596988678, 0.4007551372051239, 1.384896993637085, 4.394467353820801],
    ]
    torch.testing.assert_close(seeded_exponential(keys, 4), torch.tensor(expected))
    params = [sampling(seed=s) for s in (1, 2, 3)]
    tokens, _ = Sampler(CPU)(torch.zeros(3, 1000), params, [0, 5, 9])
    assert tokens.tolist() == [180, 480, 353]


def test_seeded_rows_create_no_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows cost a few batched tensor ops, not a torch.Generator (and its kernel
    launches) per row: only the engine's own generator exists."""
    made: list[object] = []
    real = torch.Generator

    def counting(*args: object, **kwargs: object) -> torch.Generator:
        made.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler_module.torch, "Generator", counting)
    sampler = Sampler(CPU, 0)
    assert len(made) == 1
    logits = torch.randn(64, 500)
    params = [sampling(seed=i) if i % 2 else sampling() for i in range(64)]
    sampler(logits, params, list(range(64)))
    sampler(logits, [sampling(seed=i, top_p=0.9) for i in range(64)], [0] * 64)
    assert len(made) == 1


def test_all_seeded_batch_equals_mixed_batch() -> None:
    """The all-seeded shortcut (no engine noise drawn at all) and the mixed path agree."""
    torch.manual_seed(9)
    logits = torch.randn(6, 300)
    seeded = [sampling(temperature=1.2, seed=40 + i) for i in range(6)]
    alone, _ = Sampler(CPU)(logits, seeded, [2] * 6)
    mixed = logits.repeat(2, 1)
    params = seeded + [sampling(temperature=1.2)] * 6
    together, _ = Sampler(CPU, 3)(mixed, params, [2] * 12)
    assert torch.equal(together[:6], alone)


@pytest.mark.gpu
def test_seeded_noise_and_tokens_same_on_cuda() -> None:
    cuda = torch.device("cuda")
    keys = torch.tensor([seed_for(s, i) for s in range(16) for i in range(8)])
    cpu_noise = seeded_exponential(keys, 32_000)
    gpu_noise = seeded_exponential(keys.to(cuda), 32_000).cpu()
    assert torch.equal(cpu_noise, gpu_noise)
    torch.manual_seed(10)
    logits = torch.randn(128, 32_000)
    params = [sampling(temperature=0.9, top_k=50, seed=s) for s in range(128)]
    on_cpu, _ = Sampler(CPU)(logits, params, list(range(128)))
    on_gpu, _ = Sampler(cuda)(logits.to(cuda), params, list(range(128)))
    assert torch.equal(on_cpu, on_gpu.cpu())


# ---- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        sampling(temperature=0.0, logprobs=True),
        sampling(temperature=0.7, top_k=5, logprobs=True),
        sampling(temperature=1.3, top_p=0.5, min_p=0.1, logprobs=True, seed=9),
    ],
)
def test_logprobs_are_raw_log_softmax_at_the_chosen_token(params: SamplingParams) -> None:
    torch.manual_seed(7)
    logits = torch.randn(64, 300) * 2
    tokens, chosen = Sampler(CPU)(logits, [params] * 64, list(range(64)))
    assert chosen is not None
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(chosen.double(), expected, rtol=0, atol=1e-5)


def test_logprobs_only_when_someone_asks() -> None:
    logits = torch.randn(3, 10)
    _, chosen = Sampler(CPU)(logits, [sampling()] * 3, [0] * 3)
    assert chosen is None
    params = [sampling(), sampling(logprobs=True), sampling(temperature=0)]
    tokens, chosen = Sampler(CPU)(logits, params, [0] * 3)
    assert chosen is not None and chosen.shape == (3,)
    assert float(chosen[1]) == pytest.approx(
        float(torch.log_softmax(logits[1], -1)[tokens[1]]), abs=1e-6
    )


# ---- masked tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        sampling(),
        sampling(temperature=0.3),
        sampling(top_k=3),
        sampling(top_p=0.9),
        sampling(min_p=0.05),
        sampling(seed=1),
        sampling(temperature=0.0),
    ],
)
def test_masked_tokens_never_picked(params: SamplingParams) -> None:
    n, vocab = 4000, 16
    torch.manual_seed(8)
    logits = torch.randn(n, vocab)
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, 2] = True
    allowed[:, 9] = True
    allowed[: n // 2, 13] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    plist = [params if params.seed is None else sampling(seed=i) for i in range(n)]
    tokens, chosen = Sampler(CPU)(logits, plist, [0] * n)
    assert bool(allowed.gather(1, tokens[:, None]).all())
    assert chosen is None


def test_single_allowed_token_with_logprobs() -> None:
    logits = torch.full((8, 32), float("-inf"))
    logits[torch.arange(8), torch.arange(8) * 3] = torch.linspace(-50, 50, 8)
    params = [sampling(temperature=t, logprobs=True) for t in (0.0, 0.5, 1.0, 2.0)] * 2
    tokens, chosen = Sampler(CPU)(logits, params, [0] * 8)
    assert tokens.tolist() == [i * 3 for i in range(8)]
    assert chosen is not None
    assert chosen.tolist() == [0.0] * 8
    assert not any(math.isnan(v) for v in chosen.tolist())


# ---- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_moves_greedy_rows_and_leaves_logprobs() -> None:
    """+100 makes a token the argmax, -100 takes the argmax away; logprobs stay those of the
    unmodified distribution; rows without a bias are untouched."""
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    top = logits.argmax(dim=-1)
    params = [
        sampling(temperature=0.0, logprobs=True, logit_bias={7: 100.0}),
        sampling(temperature=0.0, logprobs=True, logit_bias={int(top[1]): -100.0}),
        sampling(temperature=0.0, logprobs=True),
    ]
    tokens, logprobs = Sampler(CPU)(logits, params, [0] * 3)
    second = logits[1].clone()
    second[top[1]] -= 100.0
    assert tokens.tolist() == [7, int(second.argmax()), int(top[2])]
    assert logprobs is not None
    reference = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, reference)


def test_logit_bias_shifts_sampled_frequencies() -> None:
    """Sampled: a bias of log(b) multiplies a token's odds by b (softmax of the biased logits)."""
    bias = {2: math.log(6.0), 3: -100.0}
    counts = draw_counts(LOGITS, sampling(logit_bias=bias))
    biased = LOGITS.clone()
    for token_id, value in bias.items():
        biased[token_id] += value
    assert_frequencies(counts, torch.softmax(biased.double(), dim=-1))


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 101.0}, "sampling.logit_bias[5]=101.0 must be in [-100, 100]"),
        ({5: float("nan")}, "sampling.logit_bias[5]=nan must be in [-100, 100]"),
        ({i: 1.0 for i in range(1025)}, "sampling.logit_bias has 1025 entries; at most 1024"),
    ],
)
def test_logit_bias_limits(bias: dict[int, float], message: str) -> None:
    with pytest.raises(SamplingError) as err:
        sampling(logit_bias=bias)
    assert str(err.value) == message
