"""Losslessness of the speculative engines, proven statistically against the exact distribution.

A tiny random GPT (vocabulary 4, 2x2 grid) makes every 4-token image enumerable: the exact probability
of each sequence under vanilla sampling (CFG 2.5, temperature 1, top-k 3) is computed from the target,
and each engine's samples are checked against it with a chi-square test. The same test rejects a
deliberately wrong acceptance rule, so it has the power to fail.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import decoding.engines.tree as tree_module
from decoding.engines import build_engine
from decoding.sampling import SamplingParams, cfg_combine, filtered_probs, sample_from
from tests.conftest import labels

SAMPLING = dict(cfg_scale=2.5, temperature=1.0, top_k=3)
N_SAMPLES = 6000
ENGINES = {
    "vanilla": {},
    "eagle2": dict(total_tokens=6, depth=3, width=2),
    "adt_tree": dict(total_tokens=6, depth=2, width=2, d_min=1, d_max=3, w_min=1, w_max=3),
    "adt_tree-2d": dict(total_tokens=6, depth=2, width=2, d_min=1, d_max=3, w_min=1, w_max=3, adjacency="2d"),
}


@torch.no_grad()
def exact_distribution(bundle, label: int = 1) -> dict:
    gpt, sp = bundle.gpt, SamplingParams(**SAMPLING)
    V, N = gpt.args.vocab_size, gpt.args.block_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N)))
    lab = torch.full((len(seqs),), label)
    emb = torch.cat([gpt.embed_condition(lab), gpt.embed_condition(lab, torch.ones(len(seqs), dtype=torch.bool))])
    logits, _ = gpt.forward_train(emb, torch.cat([seqs, seqs]))
    probs = filtered_probs(cfg_combine(logits, sp), sp).gather(2, seqs[..., None])[..., 0].prod(1)
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), probs)}


def sample_pvalue(bundle, exact: dict, settings: dict, seed0: int = 0) -> float:
    engine = build_engine(bundle, {"name": settings.get("name", "vanilla"), **SAMPLING, **settings})
    results = engine.generate(labels(N_SAMPLES), list(range(seed0, seed0 + N_SAMPLES)))
    counts = {}
    for r in results:
        counts[tuple(r.tokens.tolist())] = counts.get(tuple(r.tokens.tolist()), 0) + 1
    assert all(exact.get(s, 0) > 0 for s in counts), "an engine produced a sequence vanilla never samples"
    support = sorted((s for s in exact if exact[s] > 0), key=lambda s: -exact[s])
    expected = np.array([exact[s] for s in support]) * N_SAMPLES
    observed = np.array([counts.get(s, 0) for s in support], float)
    big = expected >= 5  # pool the rare sequences into one cell
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def exact(tiny):
    return exact_distribution(tiny)


@pytest.mark.parametrize("variant", list(ENGINES))
def test_engine_samples_the_vanilla_distribution(tiny, exact, variant):
    settings = {"name": variant.split("-")[0], **ENGINES[variant]}
    assert sample_pvalue(tiny, exact, settings) > 1e-3


def wrong_verify(probs, tokens, children, rng, lantern=None):
    """A broken rule: accept each child with its unrenormalised p, bonus from the full p."""
    path, p_acc, node = [], [], 0
    while True:
        for child in children[node]:
            if rng.random() < probs[node, tokens[child]]:
                path.append(child)
                p_acc.append(float(probs[node, tokens[child]]))
                node = child
                break
        else:
            bonus = sample_from(probs[node], rng.random())
            return path, bonus, p_acc, float(probs[node, bonus])


def test_the_test_rejects_a_wrong_acceptance_rule(tiny, exact, monkeypatch):
    monkeypatch.setattr(tree_module, "verify_tree", wrong_verify)
    assert sample_pvalue(tiny, exact, {"name": "eagle2", **ENGINES["eagle2"]}) < 1e-6


@pytest.mark.parametrize("variant", ["vanilla", "eagle2", "adt_tree"])
def test_image_does_not_depend_on_its_batch(tiny, variant):
    """Per-prompt random streams: the same seed gives the same tokens alone or among others."""
    engine = build_engine(tiny, {"name": variant, **SAMPLING, **ENGINES[variant]})
    together = engine.generate(labels(5), [11, 12, 13, 14, 15])
    alone = engine.generate(labels(1), [13])
    assert together[2].tokens.tolist() == alone[0].tokens.tolist()
    assert together[2].records["p_target"] == pytest.approx(alone[0].records["p_target"], abs=1e-6)
