"""Chain steps of the tree engines (proposers.py `ChainProposer`): the target verifies a chain of its own draws of
the step before, with the drafter resting. Exact acceptance commits the target's draws, so the tokens
stay vanilla's whatever the chain holds (checked here, and statistically in tests/test_lossless.py;
every chain node's verified distribution is checked against a cache-free forward in
tests/test_oracle.py). What tokens cannot show is a chain that drafts the wrong things: each chain is
checked here against the draws a cache-free target makes after the prefix and the chain before it."""
from __future__ import annotations

import pytest

from decoding.engines import build_engine, engine_config
from decoding.engines.requests import Request
from decoding.engines.planner import CHAIN_COST
from decoding.engines.budget import CHAIN_RUN, FLOOR_SAMPLES, PROBE_MAX, PROBE_SHARE, Budget, bucket
from decoding.engines.verify import draws
from decoding.sampling import Streams, sample
from tests.conftest import COSTS, cost_file, labels, tiny_bundle
from tests.test_budget import PLAIN, SAMPLING, alternate, run, table, with_width
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
    nothing of the image before (its draws were for other positions): an image's first chain, at one
    committed token, copies that token into every lane (no row above is committed yet)."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 12)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=5, costs=COSTS))
    mixed(engine, [1, 0, 0], [0, 4])        # an image may end on any kind of step, its last draws unused
    calls = record_chains(engine)
    outs = list(engine.stream((Request(c, 100 + i, key=i) for i, c in enumerate(labels(12).split())), slots=5))
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    got = {o.key: o.result.tokens.tolist() for o in outs}
    assert [got[i] for i in range(12)] == [r.tokens.tolist() for r in ref]
    first = [(c[b][e[b]], root[b]) for P, c, e, root in calls for b in range(len(P)) if int(P[b]) - engine.L == 0]
    assert len(first) >= 5 and all((lanes == r).all() for lanes, r in first)


def mixed(engine, chain_pattern, tree_pattern):
    """Chain, tree and plain steps in a fixed mix: the chain budget's plan cycles through chain_pattern
    (1: a chain step), the tree's through tree_pattern where the chain's says 0."""
    engine.planner.chains_pay = lambda R: True
    calls = iter(range(10**9))
    engine.chain_budget.plan = lambda R, pending, confidence=None: chain_pattern[next(calls) % len(chain_pattern)]
    alternate(engine, tree_pattern)
    # nothing from the clock: a tree verifies its planned nodes (as budget=fixed does, not the measured
    # drafting time's choice), and no run of steps is declared quiet from measured goodput
    engine.budget.choose = lambda R, values, plan, drafted_ms: min(plan, values.shape[1])
    for b in (engine.budget, engine.chain_budget):
        b.quiet = lambda R, pending: 0


def test_chain_tree_and_plain_steps_mixed_commit_vanillas_tokens():
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 24)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=5, costs=COSTS))
    mixed(engine, [1, 1, 0, 0, 1, 0], [0, 6])
    out = engine.generate(labels(24), range(100, 124))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    width = [w for r in out for w in r.records["tree_width"]]
    budget = [k for r in out for k in r.records["budget"]]
    assert 0 in budget and 1 in width and any(w > 1 for w in width)   # plain, chain and tree steps


def record_chains(engine) -> list:
    """(P [B], chain tokens [B, K], nodes [B, K], root [B]) of every chain step's verified tree."""
    calls, forward, speculate = [], engine.verifier.forward, engine.speculate
    in_chain = []

    def step(st, active, kind, *a, **k):
        in_chain.append(kind == "chain")
        try:
            return speculate(st, active, kind, *a, **k)
        finally:
            in_chain.pop()

    def spy(target, tree, P):
        if in_chain and in_chain[-1]:
            calls.append((P.clone(), tree.tok[:, 1:].clone(), (tree.parent[:, 1:] >= 0).clone(), tree.tok[:, 0].clone()))
        return forward(target, tree, P)
    engine.verifier.forward, engine.speculate = spy, step
    return calls


@pytest.mark.parametrize("pattern", [[1], [1, 1, 0, 1, 0, 0]])
def test_each_chain_is_the_targets_draws_after_the_chain_before_it(pattern):
    """A chain step at count n verifies chain c_1..c_K (c_k for token n - 1 + k); the target's draw after
    node k is its token n + k given prefix + c_1..c_k, with vanilla's uniform. The next chain step, at
    count n', drafts token n' + j with that draw where one was made (k = n' + j - n <= K), whatever plain
    or tree steps ran between; the other lanes copy the token one image row above, or the last one."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, total_tokens=6, chain=5, costs=COSTS))
    mixed(engine, pattern, [0, 4])
    engine.regroups = False   # rows keep their places (b below)
    calls = record_chains(engine)
    seeds = list(range(100, 100 + B))
    results = engine.generate(labels(B), seeds)
    final = [r.tokens.tolist() for r in results]
    L, N, G, sp = engine.L, engine.N, engine.G, engine.sampling
    u = draws(Streams(seeds, "cpu"), N)
    rows, seqs, where = [], [], []
    checked = copied = 0
    for (P1, c1, e1, _), (P2, c2, e2, _) in zip(calls, calls[1:]):
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


# -- the chain's budget (budget.py, Budget(chain=...)) ------------------------------------------------------
def chain_budget(target=lambda R, T: 10.0 + 0.01 * T, drafter=lambda R, T: 0.05 * R * T ** 0.5) -> Budget:
    return Budget(table(target, drafter), max_nodes=0, width=1, chain=16)


def test_a_chain_costs_a_target_forward_over_its_tokens_and_no_drafter():
    """K = 1 is the one chain length; its cost is the target's forward over 1 + 16 tokens, however dear
    the drafter (it rests), and its prior value says a chain step pays where that forward is cheap."""
    cheap, dear_drafter = chain_budget(), chain_budget(drafter=lambda R, T: 1000.0)
    assert cheap.max == 1 and cheap.forward_ms(2, 32).tolist() == pytest.approx([10.01, 10.17])
    assert dear_drafter.forward_ms(2, 32).tolist() == cheap.forward_ms(2, 32).tolist()
    assert cheap.model_plan(2, 1) == 1
    steep = chain_budget(target=lambda R, T: 1.0 * R * T)            # 17 tokens cost 17 plain steps
    assert steep.model_plan(2, 1) == 0


CHAIN_WIN = lambda K: PLAIN if K == 0 else (12.0, 4.0)        # noqa: E731  a chain step: 3.3x a plain step's rate
CHAIN_LOSE = lambda K: PLAIN if K == 0 else (20.0, 1.0)       # noqa: E731  a busy stretch: 0.5x


def test_a_chains_probe_runs_its_whole_run_and_then_waits_out_its_share():
    """A chain's probe takes CHAIN_RUN steps whatever its first ones measure (they verify copies, not
    draws), and a probe that lost waits until its loss is PROBE_SHARE of the steps to the next one, even
    where chains paid before (at batch 8 on a CPU that licence had it probe its way to 0.87x vanilla)."""
    b = chain_budget()
    run(b, CHAIN_WIN, 50)                                       # chains paid here
    g = b.goodput(2)
    assert g.net > 0
    plans = run(b, CHAIN_LOSE, 400)
    first = plans.index(1) if 1 in plans else None
    assert first is not None
    runs = "".join(str(K) for K in plans).split("0")
    probes = [r for r in runs if r]
    assert all(len(r) >= CHAIN_RUN for r in probes[1:]), probes
    assert g.wait >= min(g.lost / PROBE_SHARE, PROBE_MAX) and g.lost > 0     # doubling alone: 256 by now


def test_one_busy_chain_step_does_not_switch_chains_off():
    """A chain step commits its whole chain or one token, by stretches: chains that measured 1.5x a plain
    step survive one step at half a plain step's rate (CHAIN_EMA), where a tree's bucket would not."""
    for b, K, stays in ((chain_budget(), 1, True), (Budget(table(lambda R, T: 10.0 + 0.01 * T), 16, 4), 16, False)):
        g = b.goodput(2)
        for _ in range(FLOOR_SAMPLES):
            b.observe(2, 0, step_ms=10.0)
        g.rate[bucket(K)], g.seen[bucket(K)], g.step = 1.5, 0, 1
        b.observe(2, K, step_ms=20.0, tokens_per_row=1.0)
        assert g.below_plain(bucket(K)) != stays, (K, g.rate)


@pytest.mark.parametrize("ratio, runs", [(1.5, True), (6.0, False)])
def test_chain_steps_run_only_where_the_cost_table_says_one_costs_at_most_CHAIN_COST_plain_steps(
        ratio, runs, tmp_path, monkeypatch):
    """The gate on the hardware (planner.py `chains_pay`): measured per step, chains looked like a win at
    batch 8 on a CPU where whole images lost. Above CHAIN_COST no chain step runs, and the tree's own
    budget plans as it did without chains."""
    costs = cost_file(tmp_path, target=lambda R, T: 10.0 * (1 + (ratio - 1) * (T - 1) / 16))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=16, costs=costs))
    assert (engine.costs.target(16, 17) <= CHAIN_COST * engine.costs.target(16, 1)) == runs
    out = engine.generate(labels(8), range(100, 108))
    ref = vanilla(bundle, 8)
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    chained = any((r.records["tree_width"] == 1).any() and (r.records["tree_depth"] > 6).any() for r in out)
    assert chained == runs


def test_width_holds_tree_steps_to_the_longest_row_but_not_chains(tmp_path, monkeypatch):
    """Where a slot of attention width costs the batch more than a token saves a row (planner.py `room`),
    tree steps keep every row behind the longest one (tests/test_budget.py); chain steps do not, since a
    chain commits several tokens for the width it adds (at batch 8 on a CPU, chains held to the longest
    row gave 1.03x vanilla and free ones 1.22x). Tokens stay vanilla's."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = vanilla(bundle, 8)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=5, costs=COSTS))
    with_width(engine, 0.0)
    engine.chain_budget.costs = engine.costs
    mixed(engine, [1, 0], [0])                    # chain steps, and plain ones the width may hold
    step, moves, held = engine.step, [], []
    room = engine.planner.room
    engine.planner.room = lambda st: held.append(1) or room(st)

    def traced(st):
        if len(moves) == 2:
            with_width(engine, 10.0)
        before = st.log.n.clone()
        step(st)
        moves.append((int(before.max()), int(st.log.n.max())))
    engine.step = traced
    out = engine.generate(labels(8), range(100, 108))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    later = [m for m in moves[2:] if m[0] < engine.N]
    assert any(hi > lo + 1 for lo, hi in later), moves             # the longest row moved on by a chain
    assert 0 < len(held) < len(moves)                                 # asked on the tree's turns only


def test_the_engine_reports_each_chain_step_to_the_chain_budget(tmp_path, monkeypatch):
    """What the chain's goodput is made of: each chain step reports K = 1 and 1 + the drafts it accepted
    per unfinished row, both as the step's tokens and as what the chain is worth (v_1); and the chain
    budget prices with the engine's cost table."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, total_tokens=6, chain=5, costs=COSTS))
    mixed(engine, [1, 0], [0])
    verdicts, seen = [], []
    accept, observe = engine.verifier.accept, engine.chain_budget.observe

    def spy_accept(st, prop, probs, n, active):
        v, path = accept(st, prop, probs, n, active)
        verdicts.append((v.accepted.clone(), active.clone()))
        return v, path
    engine.verifier.accept = spy_accept
    engine.chain_budget.observe = lambda R, K, ms, tokens=1.0, by_rank=None, *a, **k: (
        seen.append((K, tokens, None if by_rank is None else float(by_rank[0]))), observe(R, K, ms, tokens, by_rank, *a, **k))
    engine.generate(labels(6), range(100, 106))
    chain_seen = [s for s in seen if s[0] > 0]
    want = [1 + float(m[a].float().mean()) for m, a in verdicts]
    assert len(chain_seen) == len(want) > 5
    assert [t for _, t, _ in chain_seen] == pytest.approx(want) and [v for *_, v in chain_seen] == pytest.approx(
        [w - 1 for w in want])
    assert engine.chain_budget.costs is engine.costs


@pytest.mark.parametrize("bad, message", [
    (dict(chain=-1), "engine.chain=-1"), (dict(chain_cost=4.0), "engine.chain_cost: engine 'adt_tree' has no such"),
    (dict(total_tokens=0, chain=0), "engine.total_tokens=0"),
    (dict(total_tokens=0, chain=0, budget="fixed"), "engine.total_tokens=0")])
def test_bad_chain_settings_are_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        engine_config("adt_tree", **bad)
