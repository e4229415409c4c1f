"""τ at temperature: the speculative sampler's output follows the target's distribution (losslessness).

Chi-square tests with fixed seeds, so they cannot flake: the same draws every run. The threshold is a
p-value of 1e-3; the statistic is printed on failure. The first tests drive `verify` (the one place
the acceptance rule lives) on a small Markov "target" and a deliberately different "drafter", where
the exact distribution of the first tokens is known; a wrong rule (the rejected draft replaced by a
sample of p instead of the residual) must fail the same check. The last ones run the real loop on
SmolLM2 with a drafter built from the target's own layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.trainer.eval import GREEDY, Sampling, greedy, speculative, verify
from services.trainer.features import Target
from services.trainer.model import DFlashDrafter, feature_layer_ids
from services.trainer.model_dflash2 import DFlash2Config, DFlash2Drafter

P_MIN = 1e-3


def chi_square_p(observed: Counter, expected: dict, n: int) -> tuple[float, float]:
    """(statistic, p-value) of observed counts against expected probabilities (cells of p > 0)."""
    cells = [k for k, p in expected.items() if p > 0]
    assert sum(observed[k] for k in cells) == n, "a token outside the target's support was emitted"
    stat = sum((observed[k] - n * expected[k]) ** 2 / (n * expected[k]) for k in cells)
    dof = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p


def wrong_verify(drafts, q, target_logits, sampling, generator=None):
    """A classic bug: the first rejected draft is replaced by a sample of p, not of the residual max(0, p − q)."""
    p = sampling.probs(target_logits)
    for i in range(drafts.shape[0]):
        x = int(drafts[i])
        if float(torch.rand((), generator=generator)) * float(q[i, x]) >= float(p[i, x]):
            return i, int(torch.multinomial(p[i], 1, generator=generator))
    return drafts.shape[0], int(torch.multinomial(p[-1], 1, generator=generator))


class MarkovPair:
    """A 'target' and a 'drafter' over V tokens whose next-token distributions depend on the last token
    only: T[a] and Q[a] (logits). The drafter is deliberately unlike the target."""

    def __init__(self, V: int = 5, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.V = V
        self.target = torch.randn(V, V, generator=g) * 1.5
        self.drafter = torch.randn(V, V, generator=g) * 1.5 + 2.0 * torch.eye(V).roll(1, 1)

    def chain(self, last: int, n_drafts: int, q_sampling: Sampling, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter samples its own chain from `last`: drafts [n], q [n, V]."""
        drafts, qs, prev = [], [], last
        for _ in range(n_drafts):
            q = q_sampling.probs(self.drafter[prev])
            prev = int(torch.multinomial(q, 1, generator=g))
            drafts.append(prev)
            qs.append(q)
        return torch.tensor(drafts), torch.stack(qs)

    def first_two(self, anchor: int, n_drafts: int, sampling: Sampling, q_sampling: Sampling,
                  rule: Callable, g: torch.Generator, draft: Callable | None = None) -> tuple[int, int]:
        """Speculative cycles from `anchor` until two tokens are out. `draft(last, g) -> (drafts, q)` proposes
        (default: the Markov drafter's own chain of `n_drafts`)."""
        draft = draft or (lambda last, g: self.chain(last, n_drafts, q_sampling, g))
        out: list[int] = []
        last = anchor
        while len(out) < 2:
            drafts, q = draft(last, g)
            chain = [last, *drafts.tolist()]
            logits = torch.stack([self.target[t] for t in chain])  # after the anchor, after each draft
            accepted, following = rule(drafts, q, logits, sampling, g)
            out += [*drafts[:accepted].tolist(), following]
            last = out[-1]
        return out[0], out[1]

    def expected_first_two(self, anchor: int, sampling: Sampling) -> dict:
        P = sampling.probs(self.target)
        return {(a, b): float(P[anchor, a] * P[a, b]) for a in range(self.V) for b in range(self.V)}


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_p=0.9, top_k=4)],
                         ids=["t1", "t0.7-p0.9-k4"])
def test_speculative_sampling_matches_the_targets_distribution(sampling: Sampling) -> None:
    pair, n, g = MarkovPair(), 6000, torch.Generator().manual_seed(1234)
    # the drafter proposes from its own warped distribution (any q is allowed; this one is far from p)
    counts = Counter(pair.first_two(0, 3, sampling, Sampling(1.0), verify, g) for _ in range(n))
    stat, p = chi_square_p(counts, pair.expected_first_two(0, sampling), n)
    assert p > P_MIN, f"chi-square {stat:.1f}, p = {p:.2e}: the speculative sampler is not the target's distribution"


def test_a_dflash2_selector_walk_as_the_proposal_is_lossless() -> None:
    """DFlash 2 drafts are a chain: each slot's candidate is drawn given the one drawn before it, over only
    its top-K candidates (q is 0 elsewhere). The walk's q (`DFlash2Drafter.sample`) fed to `verify` still
    gives the target's distribution."""
    torch.manual_seed(3)
    V, D = 5, 16
    c = DFlash2Config(hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, vocab_size=V, block_size=4, num_target_layers=1,
                      target_layer_ids=[0], mask_token_id=0, conv_group_size=8, selector_rank=4, selector_top_k=3)
    drafter = DFlash2Drafter(c)
    torch.nn.init.normal_(drafter.candidate_selector.hidden_projection.weight)  # the pair term matters
    hidden, lm_head = torch.randn(3, D), torch.nn.Linear(D, V, bias=False)

    def draft(last: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return drafter.sample(hidden, lm_head, torch.tensor(last), 1.0, g)

    sampling, pair, n, g = Sampling(1.0), MarkovPair(V), 6000, torch.Generator().manual_seed(99)
    drafts, q = draft(0, g)
    assert q.shape == (3, V) and torch.allclose(q.sum(-1), torch.ones(3)) and int((q > 0).sum(-1).max()) <= 3
    assert bool((q[torch.arange(3), drafts] > 0).all())  # each draft was drawn from its row
    counts = Counter(pair.first_two(0, 3, sampling, sampling, verify, g, draft) for _ in range(n))
    stat, p = chi_square_p(counts, pair.expected_first_two(0, sampling), n)
    assert p > P_MIN, f"chi-square {stat:.1f}, p = {p:.2e}: the selector walk's q is not the drafts' distribution"


def test_a_wrong_correction_rule_fails_the_same_check() -> None:
    """The check has power: replacing a rejected draft by a sample of p (not the residual) is caught."""
    sampling, pair, n, g = Sampling(1.0), MarkovPair(), 6000, torch.Generator().manual_seed(1234)
    counts = Counter(pair.first_two(0, 3, sampling, Sampling(1.0), wrong_verify, g) for _ in range(n))
    stat, p = chi_square_p(counts, pair.expected_first_two(0, sampling), n)
    assert p < P_MIN, f"chi-square {stat:.1f}, p = {p:.2e}: the check did not catch a biased rule"


def test_verify_all_accepted_draws_the_bonus_from_the_last_row_and_greedy_is_exact() -> None:
    V, sampling = 4, Sampling(1.0)
    logits = torch.full((3, V), -30.0)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 0.0  # the target is certain: 1, then 2, then 3
    q = torch.full((2, V), 0.25)
    assert verify(torch.tensor([1, 2]), q, logits, sampling, torch.Generator().manual_seed(0)) == (2, 3)
    assert verify(torch.tensor([1, 0]), q, logits, sampling, torch.Generator().manual_seed(0)) == (1, 2)  # residual
    assert verify(torch.tensor([1, 0]), None, logits, GREEDY) == (1, 2)
    with pytest.raises(ValueError, match="proposal distribution"):
        verify(torch.tensor([1, 0]), None, logits, sampling)
    for name, bad in (("temperature", {"temperature": -1.0}), ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -2})):
        with pytest.raises(ValueError, match=name):
            Sampling(**bad)


# --- the real loop on SmolLM2 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(target_dir: Path):
    from shared.model import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    lm = load_causal_lm(str(target_dir))
    ids = feature_layer_ids(lm.config.num_hidden_layers, 5)
    d = DFlashDrafter.for_target(lm.config, num_layers=1, block_size=4, layer_ids=ids, mask_token_id=0)
    d.init_from_target(lm.model.layers)
    tok = load_tokenizer(str(target_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    return Target(lm, ids), d.eval(), prompt


@pytest.fixture(scope="module")
def real_dflash2(real):
    target, _, prompt = real
    torch.manual_seed(0)
    d = DFlash2Drafter.for_target(target.model.config, num_layers=1, block_size=4, layer_ids=target.layer_ids,
                                  mask_token_id=0, selector_rank=16, selector_top_k=4)
    d.init_from_target(target.model.model.layers)
    torch.nn.init.normal_(d.candidate_selector.hidden_projection.weight, std=0.02)  # the pair term matters
    return target, d.eval(), prompt


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_real_speculative_sampling_first_tokens_follow_the_target(arch, real, real_dflash2) -> None:
    """At a fixed context, the joint distribution of the first two tokens of the speculative sampler (the
    first from the prefill, the second from a drafted-and-verified cycle) matches the target's own,
    computed from its logits. top-k 3 keeps it to 9 cells. DFlash 2 drafts by its selector walk."""
    target, drafter, prompt = real if arch == "dflash" else real_dflash2
    sampling, n = Sampling(1.0, top_k=3), 300
    counts = Counter()
    for seed in range(n):
        toks, _ = speculative(target, drafter, prompt, 2, set(), sampling, torch.Generator().manual_seed(seed))
        counts[tuple(toks)] += 1
    with torch.no_grad():
        p0 = sampling.probs(target.model(input_ids=torch.tensor([prompt])).logits[0, -1])
        expected = {}
        for a in p0.nonzero()[:, 0].tolist():
            p1 = sampling.probs(target.model(input_ids=torch.tensor([[*prompt, a]])).logits[0, -1])
            expected.update({(a, b): float(p0[a] * p1[b]) for b in p1.nonzero()[:, 0].tolist()})
    stat, p = chi_square_p(counts, expected, n)
    assert p > P_MIN, f"chi-square {stat:.1f}, p = {p:.2e}; counts {dict(counts)}"


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_real_sampled_eval_is_reproducible_per_seed_and_greedy_unchanged(arch, real, real_dflash2) -> None:
    target, drafter, prompt = real if arch == "dflash" else real_dflash2
    sampling = Sampling(0.7, top_p=0.95)
    a = speculative(target, drafter, prompt, 24, set(), sampling, torch.Generator().manual_seed(5))
    b = speculative(target, drafter, prompt, 24, set(), sampling, torch.Generator().manual_seed(5))
    assert a == b and sum(a[1]) == len(a[0]) - 1  # every token but the first comes from a cycle
    others = {tuple(speculative(target, drafter, prompt, 24, set(), sampling, torch.Generator().manual_seed(s))[0])
              for s in range(4)}
    assert len(others) > 1  # the seed matters: it is sampling
    tokens, _ = speculative(target, drafter, prompt, 24, set())
    assert tokens == greedy(target, prompt, 24, set())  # temperature 0 stays exact greedy
