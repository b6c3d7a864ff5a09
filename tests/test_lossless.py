"""Losslessness of the speculative engines, proven statistically against the exact distribution.

Tiny random GPTs make every image enumerable, so the exact probability of each token sequence under
vanilla sampling is computed from the target (cache-free, teacher-forced) and each engine's samples
are checked against it with a chi-square test. Two worlds:
  * "small": vocabulary 4 on a 2x2 grid, CFG 2.5, temperature 1, top-k 3 (every filter path but top-p);
  * "wide": vocabulary 3 on a 3x3 grid, CFG 2, temperature 1.3, top-k 2, top-p 0.8: nine tokens, so
    trees are verified and compacted several times per image and a wrong K/V reaches many later tokens
    (a skipped compaction changes which tokens survive top-k); the temperature and top-p each move about
    0.09 of the mass (TVD against T = 1 or top-p = 1), so verification that ignores either samples a
    visibly different distribution.
The same test rejects deliberately wrong rules (so it has the power to fail). Deterministic checks:
the tree engines commit vanilla's tokens for the same seeds (below), and tests/test_oracle.py checks
every verify-time distribution against a cache-free forward.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import decoding.engines.verify as verify_module
from decoding.engines import build_engine, engine_config
from decoding.engines.verify import Verdict
from decoding.sampling import SamplingParams, cfg_combine, filtered_probs, sample
from tests.conftest import COSTS, labels, tiny_bundle

WORLDS = {
    "small": dict(bundle=dict(vocab=4, grid=2), sampling=dict(cfg_scale=2.5, temperature=1.0, top_k=3, top_p=1.0)),
    "wide": dict(bundle=dict(vocab=3, grid=3, std=0.4, seed=2),
                 sampling=dict(cfg_scale=2.0, temperature=1.3, top_k=2, top_p=0.8)),
}
N_SAMPLES = 6000
CHUNK = 1000
# budget=fixed: every step verifies a full tree (the auto budget would mostly choose plain steps on a
# model this small); tests/test_budget.py covers the budget and steps that alternate.
ENGINES = {
    "vanilla": {},
    "eagle2": dict(total_tokens=6, depth=3, width=2, budget="fixed"),
    "adt_tree": dict(total_tokens=6, depth=2, width=2, d_min=1, d_max=3, w_min=1, w_max=3, budget="fixed"),
    "adt_tree-2d": dict(total_tokens=6, depth=2, width=2, d_min=1, d_max=3, w_min=1, w_max=3, adjacency="2d",
                        budget="fixed"),
    # LANTERN with no relaxation budget is exact: its claimed sets must reduce to the drafts themselves
    "eagle2-lantern0": dict(total_tokens=6, depth=3, width=2, acceptance="lantern", lantern_k=1, lantern_delta=0.0,
                            budget="fixed"),
    # chain steps only: the drafter off, every step verifies the target's own draws of the step before
    "eagle2-chain": dict(total_tokens=0, chain=3, budget="fixed"),
    # the job's default: plain, chain and tree steps as the tests' cost table prices them
    "auto": dict(costs=COSTS),
}


@torch.no_grad()
def exact_distribution(bundle, sampling: dict, label: int = 1) -> dict:
    gpt, sp = bundle.gpt, SamplingParams(**sampling)
    V, N = gpt.args.vocab_size, gpt.args.block_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N)))
    lab = torch.full((len(seqs),), label)
    emb = torch.cat([gpt.embed_condition(lab), gpt.embed_condition(lab, torch.ones(len(seqs), dtype=torch.bool))])
    logits, _ = gpt.forward_train(emb, torch.cat([seqs, seqs]))
    probs = filtered_probs(cfg_combine(logits, sp), sp).gather(2, seqs[..., None])[..., 0].prod(1)
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), probs)}


def sample_pvalue(bundle, exact: dict, sampling: dict, variant: str, seed0: int = 0) -> float:
    name, _, _ = variant.partition("-")
    engine = build_engine(bundle, engine_config(name, sampling=sampling, **ENGINES[variant]))
    counts = {}
    for start in range(seed0, seed0 + N_SAMPLES, CHUNK):   # a chunk at a time: an impossible sequence fails fast
        for r in engine.generate(labels(CHUNK), list(range(start, start + CHUNK)), images=False):
            counts[tuple(r.tokens.tolist())] = counts.get(tuple(r.tokens.tolist()), 0) + 1
        assert all(exact.get(s, 0) > 0 for s in counts), "an engine produced a sequence vanilla never samples"
    support = sorted((s for s in exact if exact[s] > 0), key=lambda s: -exact[s])
    expected = np.array([exact[s] for s in support]) * N_SAMPLES
    observed = np.array([counts.get(s, 0) for s in support], float)
    big = expected >= 5  # pool the rare sequences into one cell
    obs, exp = observed[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request):
    w = WORLDS[request.param]
    bundle = tiny_bundle(**w["bundle"])
    return bundle, w["sampling"], exact_distribution(bundle, w["sampling"])


@pytest.mark.parametrize("variant", list(ENGINES))
def test_engine_samples_the_vanilla_distribution(world, variant):
    bundle, sampling, exact = world
    assert sample_pvalue(bundle, exact, sampling, variant) > 1e-3


TRUE_VERIFY = verify_module.verify


def one_draw_per_step(tree, probs, u, lantern=None):
    """A broken rule: every node's draw reuses the root's uniform (one uniform per step, not per token)."""
    return TRUE_VERIFY(tree, probs, u[:, :1].expand_as(u), lantern)


def first_child_on_any_match(tree, probs, u, lantern=None):
    """A broken rule: when the target's draw is any of a node's children, the first child is accepted."""
    B, T, V = probs.shape
    x = sample(probs, u)
    parent = tree.parent.clamp(min=0)
    hit = tree.node & (x.gather(1, parent) == tree.tok)
    any_child = torch.zeros(B, T + 1).scatter_add_(1, torch.where(hit, parent, T), torch.ones(B, T))[:, :T] > 0
    won = tree.node & any_child.gather(1, parent) & (tree.earlier_siblings.sum(-1) == 0)
    on_path = tree.node & (torch.bmm(tree.ancestors.float(), won.float()[..., None])[..., 0] == tree.depth)
    last = (on_path * torch.arange(T)).amax(1)
    bonus = x.gather(1, last[:, None])[:, 0]
    p_node = probs.flatten(1).gather(1, parent * V + tree.tok)
    return Verdict(on_path, on_path.sum(1), last, bonus, p_node, probs.flatten(1).gather(1, (last * V + bonus)[:, None])[:, 0], x)


@pytest.mark.parametrize("broken", [one_draw_per_step, first_child_on_any_match])
def test_the_test_rejects_a_wrong_acceptance_rule(monkeypatch, broken):
    w = WORLDS["small"]
    bundle = tiny_bundle(**w["bundle"])
    exact = exact_distribution(bundle, w["sampling"])
    monkeypatch.setattr(verify_module, "verify", broken)      # what the Verifier of every tree engine calls
    try:
        pvalue = sample_pvalue(bundle, exact, w["sampling"], "eagle2")
    except AssertionError as e:                     # rejected outright: a sequence of probability 0
        assert "never samples" in str(e)
        return
    assert pvalue < 1e-6


@pytest.mark.parametrize("variant", [v for v in ENGINES if "total_tokens" in ENGINES[v]])
def test_tree_engines_commit_vanillas_tokens(variant):
    """The deterministic check: exact acceptance commits the target's own draws with vanilla's uniforms,
    so every image is vanilla's, token for token (fp32; tiny model, 8 x 8 tokens, wide trees)."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    sampling = dict(cfg_scale=2.0, temperature=0.8, top_k=5, top_p=0.9)
    settings = dict(ENGINES[variant], total_tokens=10 if ENGINES[variant]["total_tokens"] else 0)
    ref = build_engine(bundle, engine_config("vanilla", sampling=sampling)).generate(labels(48), range(48))
    out = build_engine(bundle, engine_config(variant.partition("-")[0], sampling=sampling, **settings)).generate(
        labels(48), range(48))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    # not vacuous: drafts were accepted and saved target forwards (the tiny drafter is random: ~15% fewer)
    assert sum(int(r.records["accepted"].sum()) for r in out) > 50
    assert sum(r.target_forwards for r in out) < 0.9 * sum(r.target_forwards for r in ref)


@pytest.mark.parametrize("variant", ["vanilla", "eagle2", "adt_tree"])
def test_image_does_not_depend_on_its_batch(variant):
    """Per-prompt random streams: the same seed gives the same tokens alone or among others."""
    w = WORLDS["small"]
    engine = build_engine(tiny_bundle(**w["bundle"]), engine_config(variant.partition("-")[0], sampling=w["sampling"],
                                                                   **ENGINES[variant]))
    together = engine.generate(labels(5), [11, 12, 13, 14, 15])
    alone = engine.generate(labels(1), [13], images=False)      # as the statistical tests run: no pixels
    assert together[2].tokens.tolist() == alone[0].tokens.tolist()
    assert together[2].image.shape == (2, 2, 3) and alone[0].image is None
    # up to the rounding of a forward over 10 rows against 2 (fp32, CFG 2.5 scales a difference by 3.5)
    assert together[2].records["p_target"] == pytest.approx(alone[0].records["p_target"], abs=1e-5)
