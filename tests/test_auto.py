"""engine=auto (decoding/engines/auto.py): what it picks for each kind of model, and that what it picks is
lossless: vanilla's tokens for the same seeds (fp32), its distribution (chi-square against the exact one),
with and without a drafter. The drafter-free choice runs no draft forward at all."""
from __future__ import annotations

import copy

import numpy as np

import pytest

from decoding.engines import build_engine, check_engine, engine_config
from decoding.engines.auto import resolve
from decoding.engines.tree import ADTTree
from tests.conftest import COSTS, labels, tiny_bundle
from tests.test_lossless import WORLDS, exact_distribution, sample_pvalue

SAMPLING = dict(cfg_scale=2.0, temperature=0.8, top_k=5, top_p=0.9)


def without_drafter(bundle):
    b = copy.copy(bundle)
    b.drafter = None
    return b


def test_auto_picks_trees_with_a_drafter_chains_without_one_and_mar_for_continuous_tokens():
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    trees = build_engine(bundle, engine_config("auto", costs=COSTS))
    chains = build_engine(without_drafter(bundle), engine_config("auto", costs=COSTS))
    assert type(trees) is ADTTree and trees.trees and trees.cfg.chain > 0
    assert type(chains) is ADTTree and not chains.trees and chains.drafter is None and chains.cfg.chain > 0
    check_engine(engine_config("auto"), "continuous", False, "mar")      # a continuous model: no refusal
    assert resolve(engine_config("auto"), "continuous", True).name == "mar"
    with pytest.raises(ValueError, match=r"^engine 'adt_tree' drafts trees with a drafter.*engine=auto"):
        check_engine(engine_config("adt_tree"), "discrete", False, "llamagen_c2i")
    check_engine(engine_config("adt_tree", total_tokens=0), "discrete", False, "llamagen_c2i")


@pytest.mark.parametrize("drafter", [True, False])
def test_auto_commits_vanillas_tokens(drafter):
    """The deterministic check, through continuous batching (more prompts than rows): vanilla's tokens,
    and speculation saved target forwards; without a drafter, not one draft forward ran."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    bundle = bundle if drafter else without_drafter(bundle)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(24), range(24))
    out = build_engine(bundle, engine_config("auto", sampling=SAMPLING, costs=COSTS)).generate(labels(24), range(24))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    assert sum(r.target_forwards for r in out) < 0.9 * sum(r.target_forwards for r in ref)
    assert (sum(r.draft_forwards for r in out) > 0) == drafter


def test_auto_without_a_drafter_samples_the_vanilla_distribution():
    """The small world (tests/test_lossless.py): the wide one's 9-token images with 16-token chains over
    2000 rows took 70 s of the suite; the chain step itself is checked in both worlds there."""
    w = WORLDS["small"]
    bundle = without_drafter(tiny_bundle(**w["bundle"]))
    assert sample_pvalue(bundle, exact_distribution(bundle, w["sampling"]), w["sampling"], "auto") > 1e-3


@pytest.mark.parametrize("drafter", [True, False])
def test_the_log_says_what_proposed_each_token(drafter):
    """The proposer column (decoding/engines/log.py Proposer): a plain step's token (and the first, the
    prefill's) 0, verified nothing (budget 0); a chain's 1, a tree of width 1 (0 past the image's end); a
    drafter tree's 2, a tree of width >= 2 (adt_tree's w_min). Without a drafter no token is a tree's.
    (4 prompts: at this batch the tests' cost table takes tree steps too, at 24 chains alone.)"""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    bundle = bundle if drafter else without_drafter(bundle)
    out = build_engine(bundle, engine_config("auto", sampling=SAMPLING, costs=COSTS)).generate(labels(4), range(4))
    rec = {k: np.concatenate([r.records[k] for r in out]) for k in ("proposer", "tree_width", "budget")}
    kinds = set(rec["proposer"].tolist())
    assert kinds == ({0, 1, 2} if drafter else {0, 1}), kinds
    assert (rec["budget"][rec["proposer"] == 0] == 0).all()
    assert (rec["tree_width"][rec["proposer"] == 1] <= 1).all()
    assert (rec["tree_width"][rec["proposer"] == 2] >= 2).all()
