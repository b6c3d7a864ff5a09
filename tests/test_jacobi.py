"""The drafter-free Jacobi engines (`sjd`, `mc_sjd`): lossless, statistically and deterministically.

* statistical: chi-square of whole images against the exact enumerated distribution (tests/test_lossless.py),
  in its "wide" world (nine tokens; CFG 2, temperature 1.3, top-k 2, top-p 0.8), for both engines, both
  initialisations, both ways of scoring a new token and both couplings; the same test, in the cheaper
  "small" world, rejects deliberately wrong rules (accepting with p instead of p/q, a residual that does
  not subtract q, a coupled draft that keeps q_old, a copied draft scored as random);
* deterministic: every distribution a window forward produces equals a cache-free forward over prefix +
  window (tests/test_oracle.py's oracle), and greedy decoding reproduces vanilla's tokens exactly;
* an image does not depend on its batch (size or order); the token log says what each iteration did.

Only tokens are looked at here, so the tiny bundles skip the VQ decoder (`tokens_only`): decoding 6000
images costs more than generating them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import decoding.engines.chains as chains
import decoding.engines.verify as verify
import tests.test_lossless as lossless
from decoding.engines import build_engine, engine_config
from decoding.sampling import sample
from tests.conftest import COSTS, labels, tiny_bundle
from tests.test_oracle import B, SAMPLING, conditions, oracle

# windows shorter than the image: drafts are carried, coupled and shifted over several iterations, and
# clipped at the last token; both initialisations
VARIANTS = {
    "sjd": dict(chain=2),
    "sjd-repeat": dict(chain=3, init="repeat"),
    "mc_sjd": dict(chain=4),
    "mc_sjd-repeat": dict(chain=3, init="repeat"),
    "mc_sjd-gumbel": dict(chain=3, coupling="gumbel"),
    "mc_sjd-above": dict(chain=3, init="above"),
}
N_BROKEN = 3000     # samples for a wrong rule: enough for p < 1e-6 (the weakest, coupled_keeps_q_old, ~1e-8 at 2000)


def tokens_only(bundle):
    """The bundle with the VQ decoder skipped (blank 1x1 images): these tests read tokens only."""
    bundle.decode = lambda tokens: np.zeros((len(tokens), 1, 1, 3), np.uint8)
    return bundle


def build(bundle, variant: str, **over):
    name = variant.partition("-")[0]
    return build_engine(bundle, engine_config(name, **{**VARIANTS.get(variant, {}), **over}))


@pytest.fixture(scope="module")
def wide():
    w = lossless.WORLDS["wide"]
    bundle = tokens_only(tiny_bundle(**w["bundle"]))
    return bundle, w["sampling"], lossless.exact_distribution(bundle, w["sampling"])


def pvalue(monkeypatch, bundle, exact, sampling, variant) -> float:
    monkeypatch.setitem(lossless.ENGINES, variant, VARIANTS[variant])
    return lossless.sample_pvalue(bundle, exact, sampling, variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_jacobi_samples_the_vanilla_distribution(wide, variant, monkeypatch):
    bundle, sampling, exact = wide
    assert pvalue(monkeypatch, bundle, exact, sampling, variant) > 1e-3


def test_jacobi_windows_beside_drafter_trees_sample_the_vanilla_distribution(wide, monkeypatch):
    """mc_sjd with a drafter: Jacobi windows, drafter trees (matched with vanilla's keys) and plain steps in
    one stream, in a fixed mix (tests/test_chain.py's `mixed`, nothing from the clock)."""
    from tests.test_chain import mixed
    bundle, sampling, exact = wide
    build, kinds = lossless.build_engine, set()

    def mixing(b, cfg):
        engine = build(b, cfg)
        mixed(engine, [1, 0, 1, 0, 0], [0, 3])
        generate = engine.generate
        engine.generate = lambda *a, **k: [kinds.update(r.records["proposer"].tolist()) or r for r in generate(*a, **k)]
        return engine
    monkeypatch.setattr(lossless, "build_engine", mixing)
    monkeypatch.setitem(lossless.ENGINES, "mc_sjd-trees", dict(chain=3, total_tokens=3, depth=2, width=2, budget="auto", costs=COSTS))
    assert lossless.sample_pvalue(bundle, exact, sampling, "mc_sjd-trees") > 1e-3
    assert kinds == {0, 2, 3}                                  # plain, tree and Jacobi steps all ran


def test_a_carried_draft_keeps_its_law_when_plain_and_tree_steps_move_the_row():
    """After plain and tree steps moved a row's n, each draft a Jacobi window carries is scored with the
    distribution the last Jacobi step computed for its token (that step's probs at the token's block)."""
    from tests.test_chain import mixed
    bundle = tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3))
    engine = build_engine(bundle, engine_config("mc_sjd", sampling=SAMPLING, chain=4, total_tokens=3, depth=2, width=2,
                                                budget="auto", costs=COSTS))
    mixed(engine, [1, 0, 1, 0, 0], [0, 3])
    engine.regroups = False
    steps, accept = [], engine.verifier.accept

    def spy(st, prop, probs, n, active):
        if prop.law is not None:
            steps.append((n.clone(), prop.tree.node.clone(), prop.law.clone(), probs.clone()))
        return accept(st, prop, probs, n, active)
    engine.verifier.accept = spy
    engine.generate(labels(B), list(range(B)))
    checked = 0
    for (n0, node0, _, p0), (n1, node1, law1, _) in zip(steps, steps[1:]):
        for b in range(B):
            for j in range(1, law1.shape[1]):
                i = int(n1[b]) + j - 1 - int(n0[b])          # the token's block in the step before
                if node1[b, j] and 1 <= i < p0.shape[1] and node0[b, i] and int(n1[b]) > int(n0[b]) + 1:
                    assert torch.equal(law1[b, j], p0[b, i]), (b, j, i)
                    checked += 1
    assert checked > 20


# -- wrong rules the statistical test must reject -------------------------------------------------------
TRUE = {"trial": verify.trial, "learn": chains.ChainProposer.learn, "fill": chains.fill}


def accept_with_p(p, q, x, u, key_res):
    """Wrong: a draft passes with probability p(x), not min(1, p(x)/q(x))."""
    _, fix = TRUE["trial"](p, q, x, u, key_res)
    return u < p.gather(-1, x[..., None])[..., 0], fix


def residual_without_q(p, q, x, u, key_res):
    """Wrong: after a rejection the token is drawn from p, not from norm(max(p - q, 0))."""
    passed, _ = TRUE["trial"](p, q, x, u, key_res)
    return passed, sample(p, key_res)


def coupled_keeps_q_old(self, st, prop, v, probs, n, active, m_max):
    """Wrong (SCD's Lumina code): a draft the coupling kept keeps the q it was drawn from, not p."""
    out = TRUE["learn"](self, st, prop, v, probs, n, active, m_max)
    K, V = prop.K, probs.shape[-1]
    node = (v.accepted[:, None] + 2 + torch.arange(K)).clamp(max=K)     # the node each next lane's draft was
    kept = v.passed.gather(1, node) & (v.accepted[:, None] + 2 + torch.arange(K) <= K)
    old = prop.law.gather(1, node[..., None].expand(-1, -1, V))
    st.chain_law = torch.where(kept[..., None], old, st.chain_law)
    return out


def copies_scored_uniform(init, e, st, n, drawn, old):
    """Wrong: a copy of the left neighbour scored as if it were a uniformly random token."""
    tok, copy = TRUE["fill"](init, e, st, n, drawn, old)
    return tok, torch.zeros_like(copy)


BROKEN = {  # rule -> (where it lives, replacement, the variant it breaks, the world that shows it)
    "accept_with_p": (verify, "trial", accept_with_p, "sjd", "small"),
    "residual_without_q": (verify, "trial", residual_without_q, "sjd", "small"),
    # on 2x2 images a chain reaches past its first rejection once in ~6 images: p ~5e-4 at 6000
    "coupled_keeps_q_old": (chains.ChainProposer, "learn", coupled_keeps_q_old, "mc_sjd", "wide"),
    "copies_scored_uniform": (chains, "fill", copies_scored_uniform, "mc_sjd-repeat", "small"),
}


@pytest.fixture(scope="module")
def small():
    w = lossless.WORLDS["small"]
    bundle = tokens_only(tiny_bundle(**w["bundle"]))
    return bundle, w["sampling"], lossless.exact_distribution(bundle, w["sampling"])


@pytest.mark.parametrize("rule", list(BROKEN))
def test_the_test_rejects_a_wrong_rule(request, monkeypatch, rule):
    owner, attr, broken, variant, world = BROKEN[rule]
    bundle, sampling, exact = request.getfixturevalue(world)
    monkeypatch.setattr(owner, attr, broken)
    monkeypatch.setattr(lossless, "N_SAMPLES", N_BROKEN)
    assert pvalue(monkeypatch, bundle, exact, sampling, variant) < 1e-6


# -- deterministic ----------------------------------------------------------------------------------------
def record_windows(engine) -> list:
    """Wrap the engine's verification: keep (n, window drafts, p) of every iteration (rows keep their
    places: prompt b in row b)."""
    calls, accept = [], engine.verifier.accept
    engine.regroups = False

    def spy(st, prop, probs, n, active):
        calls.append((n.clone(), prop.tree.tok[:, 1:].clone(), probs.clone()))
        return accept(st, prop, probs, n, active)
    engine.verifier.accept = spy
    return calls


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("variant", ["sjd", "mc_sjd-repeat", "mc_sjd-gumbel"])
def test_every_window_distribution_matches_a_cache_free_forward(variant, model_type):
    """p at every window lane = the filtered distribution after prefix + the drafts before that lane,
    computed without a cache (CFG, temperature 0.8, top-k, top-p; padded captions for t2i)."""
    bundle = tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3, model_type=model_type))
    engine = build(bundle, variant, sampling=SAMPLING, chain=5)
    calls = record_windows(engine)
    cond = conditions(bundle, model_type)
    results = engine.generate(cond, list(range(100, 100 + B)))
    final = [r.tokens.tolist() for r in results]
    N = engine.N
    rows, seqs, got = [], [], []
    for n, tok, p in calls:
        for b in range(B):
            n_b = int(n[b])
            for i in range(min(tok.shape[1] + 1, N - n_b) if n_b < N else 0):
                rows.append(b)
                seqs.append(final[b][:n_b] + tok[b, :i].tolist())
                got.append(p[b, i])
    want = oracle(bundle, cond, rows, seqs, engine.sampling)
    diff = (torch.stack(got) - want).abs().max().item()
    assert diff < 2e-5, f"{variant}: a window distribution differs from the cache-free forward by {diff:.3g}"
    assert len(calls) > 3 and len(seqs) > 100
    assert any(r.records["accept_len"].max() > 2 for r in results)     # windows were accepted in part
    # the recorded p_target of every committed token is the oracle's probability of that token
    rows = [b for b in range(B) for i in range(N)]
    p = oracle(bundle, cond, rows, [final[b][:i] for b in range(B) for i in range(N)], engine.sampling)
    p = p.gather(1, torch.tensor([final[b][i] for b in range(B) for i in range(N)])[:, None])[:, 0]
    logged = torch.tensor([float(r.records["p_target"][i]) for r in results for i in range(N)])
    assert (p - logged).abs().max().item() < 2e-5


GREEDY = dict(cfg_scale=2.0, temperature=0.0, top_k=0, top_p=1.0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_reproduces_vanilla_greedy(variant):
    bundle = tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3, model_type="t2i"))
    cond = conditions(bundle, "t2i")
    want = build(bundle, "vanilla", sampling=GREEDY).generate(cond, list(range(B)))
    got = build(bundle, variant, sampling=GREEDY).generate(cond, list(range(B)))
    assert [r.tokens.tolist() for r in got] == [r.tokens.tolist() for r in want]
    assert sum(r.target_forwards for r in got) < sum(r.target_forwards for r in want)


@pytest.fixture(scope="module")
def shipped():
    """The shipped shapes model (fp32), two prompts, and greedy vanilla's tokens for them."""
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    bundle = tokens_only(load_bundle(ShapesConfig(dtype="float32", device="cpu")))
    cond = bundle.conditions(["a small green star in the center on a blue background",
                              "a small orange star at the top left on a speckled white background"])
    want = build(bundle, "vanilla", sampling=dict(temperature=0.0)).generate(cond, [0, 1])
    return bundle, cond, [r.tokens.tolist() for r in want]


@pytest.mark.parametrize("variant", ["sjd", "mc_sjd", "mc_sjd-gumbel"])
def test_greedy_on_the_shipped_model(shipped, variant):
    """Greedy Jacobi (16 drafts) = greedy vanilla on the shipped model, token for token."""
    bundle, cond, want = shipped
    got = build(bundle, variant, sampling=dict(temperature=0.0), chain=16).generate(cond, [0, 1])
    assert [r.tokens.tolist() for r in got] == want


@pytest.fixture(scope="module")
def grid4():
    """Vocabulary 8 on a 4x4 grid: several iterations per image, and (unlike the wide world, where most
    trials are certain) acceptance uniforms that decide outcomes."""
    return tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_image_does_not_depend_on_its_batch(grid4, variant):
    """Seed 13 alone, third of five, and fourth of five in reverse order: the same tokens and records."""
    engine = build(grid4, variant, sampling=SAMPLING)
    together = engine.generate(labels(5), [11, 12, 13, 14, 15])[2]
    reverse = engine.generate(labels(5), [16, 15, 14, 13, 12])[3]
    alone = engine.generate(labels(1), [13])[0]
    for other in (together, reverse):
        assert other.tokens.tolist() == alone.tokens.tolist()
        for k in ("step", "accept_len", "accepted"):
            assert other.records[k].tolist() == alone.records[k].tolist()
        assert other.records["p_target"] == pytest.approx(alone.records["p_target"], abs=1e-6)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_image_does_not_depend_on_when_it_joined_a_continuous_batch(grid4, variant):
    """Six prompts through two rows: each later prompt takes a row freed mid-stream, its batch-mate part
    way through its image. A row's draws are keyed by its own iterations, so each image is the one its
    prompt gives alone."""
    from decoding.engines.requests import Request
    engine = build(grid4, variant, sampling=SAMPLING)
    seeds = [21, 22, 23, 24, 25, 26]
    outs = {o.key: o.result for o in engine.stream((Request(c, s, key=s) for c, s in zip(labels(6).split(), seeds)),
                                                   slots=2)}
    for s in seeds:
        alone = engine.generate(labels(1), [s])[0]
        assert outs[s].tokens.tolist() == alone.tokens.tolist(), s
        assert outs[s].records["step"].tolist() == alone.records["step"].tolist(), s


@pytest.mark.parametrize("variant", ["sjd", "mc_sjd"])
def test_token_log_says_what_each_iteration_did(variant):
    """Per iteration (`step`): its tokens are contiguous, `accept_len` is their count, all but the last
    are accepted drafts (all of them when the window reached the last token), q_draft is set exactly on
    accepted drafts; target forwards = iterations + the prefill."""
    bundle = tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3))
    results = build(bundle, variant, sampling=SAMPLING).generate(labels(B), list(range(B)))
    saw_accepted = False
    for r in results:
        rec, N = r.records, len(r.tokens)
        steps = rec["step"]
        assert steps[0] == 0 and rec["accept_len"][0] == 1 and not rec["accepted"][0]
        assert (np.diff(steps) >= 0).all() and (np.diff(steps) <= 1).all()
        for s in range(1, steps.max() + 1):
            idx = np.flatnonzero(steps == s)
            k = len(idx)
            assert k >= 1 and (rec["accept_len"][idx] == k).all()
            acc = rec["accepted"][idx]
            last_reached = idx[-1] == N - 1
            assert acc[:-1].all() and (not acc[-1] or last_reached)
            saw_accepted |= bool(acc.any())
        assert (np.isfinite(rec["q_draft"]) == rec["accepted"]).all()
        assert (rec["q_draft"][rec["accepted"]] > 0).all() and (rec["p_target"] > 0).all()
        assert r.target_forwards == steps.max() + 1 and r.draft_forwards == 0
    assert saw_accepted


def test_coupling_keeps_drafts_that_sjd_throws_away():
    """Same world, same seeds: maximal coupling commits more tokens per forward than independent redraws
    (the point of MC-SJD; exact counts, not timings). 600 images: over 200, τ moves by ~0.05 with the
    seeds."""
    bundle = tokens_only(tiny_bundle(vocab=8, grid=4, seed=1, std=0.3))
    tau = {}
    for name, kw in (("sjd", {}), ("mc_sjd", {}), ("mc_sjd", dict(coupling="gumbel"))):
        e = build_engine(bundle, engine_config(name, sampling=SAMPLING, chain=8, **kw))
        tau[name + kw.get("coupling", "")] = np.mean([r.mean_accept_len for r in e.generate(labels(600), list(range(600)), images=False)])
    # maximal: 1.14-1.17x sjd on three sets of seeds; gumbel: 1.065-1.10x (a weaker coupling)
    assert tau["mc_sjd"] > 1.1 * tau["sjd"] and tau["mc_sjdgumbel"] > 1.03 * tau["sjd"], tau


@pytest.mark.parametrize("bad, message", [
    (dict(chain=0), "engine.chain=0"), (dict(init="spiral"), "engine.init='spiral'"),
    (dict(coupling="copula"), "engine.coupling='copula'")])
def test_bad_settings_are_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        engine_config("mc_sjd", **bad)
