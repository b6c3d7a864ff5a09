"""Chain steps of the tree engines (tree.py `_chain_step`): the target verifies a chain of its own draws of
the step before, with the drafter resting. Exact acceptance commits the target's draws, so the tokens
stay vanilla's whatever the chain holds (checked here, and statistically in tests/test_lossless.py;
every chain node's verified distribution is checked against a cache-free forward in
tests/test_oracle.py). What tokens cannot show is a chain that drafts the wrong things: each chain is
checked here against the draws a cache-free target makes after the prefix and the chain before it."""
from __future__ import annotations

import pytest
import torch

from decoding.engines import build_engine, engine_config
from decoding.engines.base import Request
from decoding.engines.verify import draws
from decoding.sampling import Streams, sample
from tests.conftest import labels, tiny_bundle
from tests.test_budget import SAMPLING, alternate
from tests.test_oracle import oracle

CHAIN = dict(total_tokens=0, chain=5, budget="fixed")          # every step a chain step of 5
B = 6


def vanilla(bundle, n=B, seed0=100):
    return build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(n), range(seed0, seed0 + n))


@pytest.mark.parametrize("name", ["eagle2", "adt_tree"])
def test_chain_steps_commit_vanillas_tokens_and_save_forwards(name):
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 24)
    out = build_engine(bundle, engine_config(name, sampling=SAMPLING, **CHAIN)).generate(labels(24), range(100, 124))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    assert sum(int(r.records["accepted"].sum()) for r in out) > 60
    assert sum(r.target_forwards for r in out) < 0.8 * sum(r.target_forwards for r in ref)


def test_rows_that_take_the_next_prompt_start_a_new_chain():
    """Continuous batching: 12 prompts through 5 slots give vanilla's tokens; a reused row's chain holds
    nothing of the image before (its draws were for other positions)."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 12)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, **CHAIN))
    outs = list(engine.stream((Request(c, 100 + i, key=i) for i, c in enumerate(labels(12).split())), slots=5))
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    got = {o.key: o.result.tokens.tolist() for o in outs}
    assert [got[i] for i in range(12)] == [r.tokens.tolist() for r in ref]


def mixed(engine, chain_pattern, tree_pattern):
    """Chain, tree and plain steps in a fixed mix: the chain budget's plan cycles through chain_pattern
    (1: a chain step), the tree's through tree_pattern where the chain's says 0."""
    engine._chains_pay = lambda R: True
    calls = iter(range(10**9))
    engine.chain.plan = lambda R, pending, confidence=None: chain_pattern[next(calls) % len(chain_pattern)]
    alternate(engine, tree_pattern)


def test_chain_tree_and_plain_steps_mixed_commit_vanillas_tokens():
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 24)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=5))
    mixed(engine, [1, 1, 0, 0, 1, 0], [0, 6])
    out = engine.generate(labels(24), range(100, 124))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    width = [w for r in out for w in r.records["tree_width"]]
    budget = [k for r in out for k in r.records["budget"]]
    assert 0 in budget and 1 in width and any(w > 1 for w in width)   # plain, chain and tree steps


def record_chains(engine) -> list:
    """(P [B], chain tokens [B, K], nodes [B, K]) of every chain step's verified tree."""
    calls, forward, chain_step = [], engine._verify_forward, engine._chain_step
    in_chain = []

    def step(*a, **k):
        in_chain.append(True)
        try:
            return chain_step(*a, **k)
        finally:
            in_chain.pop()

    def spy(target, tree, P):
        if in_chain:
            calls.append((P.clone(), tree.tok[:, 1:].clone(), (tree.parent[:, 1:] >= 0).clone()))
        return forward(target, tree, P)
    engine._verify_forward, engine._chain_step = spy, step
    return calls


@pytest.mark.parametrize("pattern", [[1], [1, 1, 0, 1, 0, 0]])
def test_each_chain_is_the_targets_draws_after_the_chain_before_it(pattern):
    """A chain step at count n verifies chain c_1..c_K (c_k for token n - 1 + k); the target's draw after
    node k is its token n + k given prefix + c_1..c_k, with vanilla's uniform. The next chain step, at
    count n', drafts token n' + j with that draw where one was made (k = n' + j - n <= K), whatever plain
    or tree steps ran between; the other lanes copy the token one image row above, or the last one."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, total_tokens=6, chain=5))
    mixed(engine, pattern, [0, 4])
    calls = record_chains(engine)
    seeds = list(range(100, 100 + B))
    results = engine.generate(labels(B), seeds)
    final = [r.tokens.tolist() for r in results]
    L, N, G, sp = engine.L, engine.N, engine.G, engine.sampling
    u = draws(Streams(seeds, "cpu"), N)
    rows, seqs, where = [], [], []
    checked = copied = 0
    for (P1, c1, e1), (P2, c2, e2) in zip(calls, calls[1:]):
        for b in range(B):
            n1, n2 = int(P1[b]) - L + 1, int(P2[b]) - L + 1
            if not (1 <= n1 < n2 < N and e1[b].any() and e2[b].any()):
                continue                                   # parked, or a new image in the row
            for j in range(int(e2[b].sum())):
                k = n2 + j - n1
                if 1 <= k <= int(e1[b].sum()):             # a draw of the step before
                    rows.append(b)
                    seqs.append(final[b][:n1] + c1[b, :k].tolist())
                    where.append((b, n1 + k, int(c2[b, j])))
                else:
                    t = n2 + j
                    assert int(c2[b, j]) == final[b][t - G if G <= t < n2 + G else n2 - 1], (b, t)
                    copied += 1
    p = oracle(bundle, labels(B), rows, seqs, sp)
    want = [int(sample(p[i], u[b, t])) for i, (b, t, _) in enumerate(where)]
    got = [c for _, _, c in where]
    checked = len(where)
    assert got == want
    assert checked > 40 and copied > 0
