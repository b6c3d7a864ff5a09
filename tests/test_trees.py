"""Draft-tree machinery: the trial rule against its exact outcome distribution, LANTERN's TVD bound,
ADT-Tree's (d, w) moves, tree construction and masks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decoding.engines import build_engine, engine_config
from decoding.engines.proposers import select
from decoding.engines.policy import AdjacencyAdaptive, bisect
from decoding.engines.verify import Lantern, Tree, codebook_neighbours, draws, node_keys, verify
from decoding.sampling import Streams
from tests.conftest import labels


def make_tree(nodes: list[tuple[int, int]], root_token: int, B: int) -> Tree:
    """nodes: (parent block index, token) in block order (0 = root); B identical rows."""
    parent = [-1] + [p for p, _ in nodes]
    depth = [0]
    for p, _ in nodes:
        depth.append(depth[p] + 1)
    rep = lambda x: torch.tensor(x).expand(B, -1).clone()  # noqa: E731
    return Tree(rep([root_token] + [t for _, t in nodes]), rep(parent), rep(depth),
                torch.full((B, len(parent)), float("nan")))


def outcome_distribution(nodes, probs: np.ndarray) -> dict:
    """Exact law of the committed block (accepted drafts + bonus) when each token is drawn from the
    distribution of the node the walk is at, and the walk moves on when it is a child."""
    children = {}
    for j, (p, t) in enumerate(nodes, start=1):
        children.setdefault(p, {})[t] = j
    out = {}

    def walk(node, prefix, prob):
        for x in range(probs.shape[1]):
            q = prob * probs[node, x]
            if q == 0:
                continue
            if x in children.get(node, {}):
                walk(children[node][x], prefix + (x,), q)
            else:
                out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + q
    walk(0, (), 1.0)
    return out


# three siblings at the root, two nodes with children of their own (their keys share positions), depth 3
TREE = [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (2, 0), (2, 5), (4, 1)]


@pytest.mark.parametrize("seed", [0, 1])
def test_verification_samples_the_target_exactly(seed):
    """Matching the target's draws against the tree, with the keys the engine uses (one per token
    position, shared across branches), commits exactly what the target samples token by token."""
    rng = np.random.default_rng(seed)
    V, B, n = 6, 40_000, 5
    probs = rng.dirichlet(np.full(V, 0.8), size=len(TREE) + 1).astype(np.float32)
    tree = make_tree(TREE, root_token=2, B=B)
    keys = node_keys(draws(Streams(range(seed * B, (seed + 1) * B), "cpu"), 16), torch.full((B,), n), tree)
    v = verify(tree, torch.from_numpy(probs).expand(B, -1, -1), keys)
    tok = tree.tok[0].tolist()
    counts = {}
    for on, bonus in zip(v.on_path.tolist(), v.bonus.tolist()):
        block = tuple(tok[j] for j in range(len(tok)) if on[j]) + (bonus,)
        counts[block] = counts.get(block, 0) + 1
    exact = outcome_distribution(TREE, probs.astype(np.float64))
    assert set(counts) <= set(exact)
    keys = sorted(exact, key=lambda k: -exact[k])
    exp = np.array([exact[k] for k in keys]) * B
    obs = np.array([counts.get(k, 0) for k in keys], float)
    big = exp >= 5
    obs, exp = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


# -- LANTERN ------------------------------------------------------------------------------------------
def first_token_tvd(probs: np.ndarray, drafts: list[int], lantern, n: int = 100_000, seed: int = 0) -> float:
    """TVD between p and the law of the first committed token when `drafts` are tried at the root."""
    tree = make_tree([(0, t) for t in drafts], root_token=0, B=n)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2**32, (n, len(drafts) + 1), generator=g)
    v = verify(tree, torch.from_numpy(probs).float().expand(n, -1, -1), keys, lantern)
    first = torch.where(v.accepted > 0, tree.tok[:, 1:].gather(1, (v.on_path[:, 1:].float().argmax(1))[:, None])[:, 0],
                        v.bonus)
    out = np.bincount(first.numpy(), minlength=probs.shape[1]) / n
    return 0.5 * np.abs(out - probs[0]).sum()


@pytest.mark.parametrize("delta", [0.1, 0.5])
def test_lantern_moves_at_most_delta_of_mass_per_token(delta):
    rng = np.random.default_rng(0)
    V = 12
    lantern = Lantern(codebook_neighbours(torch.from_numpy(rng.normal(size=(V, 3))), 4), delta)
    worst = 0.0
    for trial in range(2):
        p = rng.dirichlet(np.full(V, 0.7))
        drafts = [int(x) for x in rng.choice(V, size=3, replace=False)]
        tvd = first_token_tvd(np.tile(p, (4, 1)), drafts, lantern, seed=trial)
        worst = max(worst, tvd)
        assert tvd <= delta + 0.008  # the TVD estimate from 100k draws carries ~0.004 of noise
    # with delta > 0 the relaxation really moves mass (so the bound is not met trivially)
    assert worst > min(delta, 0.05) * 0.2


def test_lantern_with_zero_delta_is_exact():
    rng = np.random.default_rng(1)
    V = 8
    lantern = Lantern(codebook_neighbours(torch.from_numpy(rng.normal(size=(V, 2))), 3), 0.0)
    p = rng.dirichlet(np.ones(V))
    assert first_token_tvd(np.tile(p, (3, 1)), [2, 5], lantern) < 0.01


def test_codebook_neighbours_are_nearest_first_without_self():
    cb = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    assert codebook_neighbours(cb, 2).tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]
    big = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    d = torch.cdist(big, big)
    d.fill_diagonal_(float("inf"))
    assert torch.equal(codebook_neighbours(big, 5, chunk=64), d.topk(5, largest=False).indices)


# -- ADT-Tree policy ----------------------------------------------------------------------------------
BOUNDS = (2, 10, 1, 8)  # d_min, d_max, w_min, w_max


def step(d, w, alpha):
    return tuple(int(x) for x in bisect(torch.tensor(d), torch.tensor(w), torch.tensor(alpha), 0.5, BOUNDS))


def test_bisection_goes_deeper_and_narrower_when_easy():
    assert step(4, 6, 0.75) == (7, 3)   # ceil((4+10)/2), floor((6+1)/2)
    assert step(4, 6, 0.5) == (7, 3)    # alpha == beta counts as easy


def test_bisection_goes_shallower_and_wider_when_hard():
    assert step(7, 3, 0.25) == (4, 6)   # floor((7+2)/2), ceil((3+8)/2)


@pytest.mark.parametrize("seed", range(3))
def test_bisection_stays_within_bounds(seed):
    rng = np.random.default_rng(seed)
    d, w = 4, 4
    for _ in range(200):
        d, w = step(d, w, rng.random())
        assert 2 <= d <= 10 and 1 <= w <= 8
    for _ in range(10):
        d, w = step(d, w, 1.0)
    assert (d, w) == (10, 1)
    for _ in range(10):
        d, w = step(d, w, 0.0)
    assert (d, w) == (2, 8)


class Policy:
    """One row of AdjacencyAdaptive, driven with plain ints."""

    def __init__(self, adjacency="horizontal", grid=4):
        self.p = AdjacencyAdaptive(1, grid, 4, 4, (2, 10, 1, 8), 0.5, adjacency, "cpu")

    def plan(self, n, accepted):
        return tuple(int(x) for x in self.p.plan(torch.tensor([n]), torch.from_numpy(accepted)[None]))

    def update(self, d, w, accepted_drafts, drafted=None):
        self.p.update(torch.tensor([d]), torch.tensor([w]), torch.tensor([accepted_drafts]), torch.tensor([True]),
                      None if drafted is None else torch.tensor([drafted]))


def test_horizontal_adjacency_initialisation():
    pol, acc = Policy(), np.zeros(16, bool)
    assert pol.plan(1, acc) == (4, 4)            # first row: defaults
    pol.update(4, 4, accepted_drafts=4)          # easy -> (7, 2)
    assert pol.plan(3, acc) == (7, 2)            # same row: the left neighbour's adapted state
    pol.update(7, 2, accepted_drafts=0)          # hard -> (4, 5)
    assert pol.plan(5, acc) == (7, 2)            # new row: state recorded at the previous row's start
    pol.update(7, 2, accepted_drafts=0)          # first tree of row 1 -> (4, 5) recorded for row 1
    assert pol.plan(6, acc) == (4, 5)
    assert pol.plan(8, acc) == (4, 5)            # row 2 starts from row 1's record


def test_alpha_counts_against_the_depth_actually_drafted():
    """The budget cut a depth-7 tree to 3 levels and all 3 were accepted: an easy region (α = 1), not a
    hard one (3 / 7 < β)."""
    pol, acc = Policy(), np.zeros(16, bool)
    pol.plan(1, acc)
    pol.update(7, 2, accepted_drafts=3, drafted=3)
    assert pol.plan(2, acc) == (9, 1)                 # easy: ceil((7+10)/2), floor((2+1)/2)
    pol2 = Policy()
    pol2.plan(1, acc)
    pol2.update(7, 2, accepted_drafts=3)              # counted against the requested 7: hard
    assert pol2.plan(2, acc) == (4, 5)


def test_the_engine_adapts_against_the_depth_the_budget_let_it_draft(tiny, monkeypatch):
    """In the engine, a budget of 2 nodes cuts trees the policy asks 3-8 levels deep: α's base is the
    depth each row's tree really has (at most 2), not the depth asked."""
    seen, update = [], AdjacencyAdaptive.update

    def spy(self, d, w, accepted_drafts, active, drafted=None):
        seen.append((d[active].clone(), drafted[active].clone()))
        return update(self, d, w, accepted_drafts, active, drafted)
    monkeypatch.setattr(AdjacencyAdaptive, "update", spy)
    engine = build_engine(tiny, engine_config("adt_tree", total_tokens=2, depth=3, width=2, d_min=1, d_max=8,
                                              w_min=1, w_max=3, budget="fixed"))
    engine.generate(labels(8), list(range(8)))
    asked, drafted = torch.cat([a for a, _ in seen]), torch.cat([b for _, b in seen])
    assert asked.max() > 2 and 1 <= drafted.min() and drafted.max() <= 2, (asked, drafted)


def test_2d_adjacency_reads_the_row_above():
    acc = np.zeros(16, bool)
    acc[0:4] = True                               # row 0 was all accepted
    assert Policy().plan(4, acc) == (4, 4)
    assert Policy("2d").plan(4, acc) == (7, 2)    # one easy bisection step from the row above
    acc[0:4] = False
    assert Policy("2d").plan(4, acc) == (3, 6)


def test_rows_of_a_batch_adapt_independently():
    pol = AdjacencyAdaptive(2, 4, 4, 4, (2, 10, 1, 8), 0.5, "horizontal", "cpu")
    acc = torch.zeros(2, 16, dtype=torch.bool)
    d, w = pol.plan(torch.tensor([1, 1]), acc)
    pol.update(d, w, torch.tensor([4, 0]), torch.tensor([True, True]))   # row 0 easy, row 1 hard
    assert [x.tolist() for x in pol.plan(torch.tensor([3, 2]), acc)] == [[7, 3], [2, 6]]


def test_bad_bounds_fail_at_construction():
    with pytest.raises(ValueError, match="d_min"):
        engine_config("adt_tree", depth=20, d_max=10)


def test_adt_engine_logs_adapting_tree_shapes(tiny):
    engine = build_engine(tiny, engine_config("adt_tree", sampling={"cfg_scale": 2.0}, total_tokens=6, depth=2, width=2,
                                              d_min=1, d_max=3, w_min=1, w_max=3, budget="fixed"))
    r = engine.generate(labels(30), list(range(30)))
    depths = np.concatenate([x.records["tree_depth"][1:] for x in r])
    widths = np.concatenate([x.records["tree_width"][1:] for x in r])
    assert depths.min() >= 0 and depths.max() <= 3 and widths.min() >= 1 and widths.max() <= 3
    assert len(set(zip(depths.tolist(), widths.tolist()))) > 1  # the shape really changes


# -- tree construction --------------------------------------------------------------------------------
def test_tree_selection_keeps_ancestors_and_budget(tiny):
    tok = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]])
    par = torch.tensor([[-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    depth = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    score = torch.tensor([[-0.1, -1.0, -3.0, -0.3, -2.0, -4.0, -1.5, -1.2, -5.0, -6.0, -7.0, float("-inf")]])
    t = select(tok, par, depth, score, score.exp(), 5)
    # best five by score: -0.1, -0.3, -1.0, -1.2, -1.5 -> nodes 0, 3, 1, 7, 6; ordered by (depth, -score)
    assert t["depth"].tolist() == [[1, 1, 2, 2, 2]]
    assert t["score"][0].tolist() == pytest.approx([-0.1, -1.0, -0.3, -1.2, -1.5])
    assert t["parent"].tolist() == [[0, 0, 1, 2, 2]]  # block indices: 0 = root, j+1 = node j


def test_drafting_stops_where_no_deeper_node_could_enter_the_tree(monkeypatch):
    """ADT-Tree asks for up to d_max levels; a level is not drafted once no row's frontier scores above
    its K-th best candidate. The K nodes chosen must be exactly those a full-depth draft gives, step by
    step, with fewer levels drafted (shipped model, fp32), and the tokens vanilla's."""
    from decoding.engines.proposers import TreeProposer
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    from decoding.shapes.world import builtin_prompts
    bundle = load_bundle(ShapesConfig(device="cpu", dtype="float32"))
    cond = bundle.conditions([p["prompt"] for p in builtin_prompts(2, seed=5)])
    ref = build_engine(bundle, engine_config("vanilla")).generate(cond, [3, 4])
    engine = build_engine(bundle, engine_config("adt_tree", budget="fixed"))
    draft, levels = TreeProposer.draft, {"full": 0, "kept": 0}

    def both(self, dr, dfeat, P, d, w, log, keep=None):
        full = draft(self, dr, dfeat, P, d, w, log)                  # every level asked for, first
        kept = draft(self, dr, dfeat, P, d, w, log, keep=keep)       # then as the engine drafts
        pick = [select(c["tok"], c["par"], c["depth"], c["score"], c["q"], keep) for c in (full, kept)]
        for key in ("parent", "depth"):
            assert torch.equal(pick[0][key], pick[1][key]), key
        node = pick[0]["parent"] >= 0                                # padding (a done row's): never verified
        assert torch.equal(pick[0]["tok"][node], pick[1]["tok"][node])
        levels["full"] += int(full["levels"].sum())
        levels["kept"] += int(kept["levels"].sum())
        return kept
    monkeypatch.setattr(TreeProposer, "draft", both)
    out = engine.generate(cond, [3, 4])
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    assert levels["kept"] < 0.8 * levels["full"], levels
