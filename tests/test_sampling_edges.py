"""Every sampling primitive at its edges, not on average: the random bits forced to their extremes (the
hash is a bijection, so a key can be built that gives any token any bits), distributions with zeros
(top-k 1, a top-p that keeps one token, one-hot rows, an empty slot's all-zero row), temperatures near 0
and huge, LlamaGen's 16,384 codes; and the job's invariant, no committed token of zero target mass, over
long runs of every engine (docs/design.md, "Sampling")."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.engines import build_engine, engine_config
from decoding.engines.continuous import residual_sample
from decoding.engines.verify import trial
from decoding.sampling import SamplingParams, Streams, exponential, filtered_probs, pcg_hash, sample, unit
from tests.conftest import labels, tiny_bundle

M32 = 2**32 - 1
V_LLAMAGEN = 16384
TOP_ONES = [(2**24 - 1) << 8 | k for k in range(256)]          # every h whose top 24 bits are all ones
EXTREMES = sorted({0, 1, 2, 2**8 - 1, 2**9 - 1, 2**31, M32, *TOP_ONES, *[(2**23 - 1) << 9 | k for k in range(512)]})


def _inv_odd(a: int) -> int:
    return pow(a, -1, 2**32)


def unhash(y: int) -> int:
    """The x with pcg_hash(x) = y (each of its steps is a bijection of 32-bit values)."""
    w = (y ^ (y >> 22)) & M32                                       # y = w ^ (w >> 22)
    word = (w * _inv_odd(277803737)) & M32
    shift = (word >> 28) + 4                                        # word = s ^ (s >> shift); top 4 bits are s's
    s = word
    for _ in range(32 // shift + 1):
        s = word ^ (s >> shift)
    return ((s - 2891336453) * _inv_odd(747796405)) & M32


def key_giving(token: int, h: int) -> int:
    """A draw key for `sample` under which `token`'s race uniform comes from the hash value h."""
    return unhash(h) ^ token


def test_the_hash_inverse_is_right():
    xs = torch.tensor([0, 1, 12345, 2**31, M32, *range(1000, 1100)])
    assert [unhash(int(v)) for v in pcg_hash(xs)] == xs.tolist()


def test_uniforms_are_strictly_inside_0_1_in_float32_at_every_extreme_hash():
    u = unit(torch.tensor(EXTREMES))
    assert u.dtype == torch.float32
    assert bool((u > 0).all() and (u < 1).all())
    for v in (torch.log(u), torch.log1p(-u), -torch.log(u)):
        assert bool(torch.isfinite(v).all())
    assert bool((-torch.log(u) > 0).all())                          # the race divides by it
    assert float(u.max()) == 1 - 2**-24 and float(u.min()) == 2**-24


def test_race_times_are_positive_and_finite_at_every_extreme_hash():
    e = exponential(torch.tensor(EXTREMES))
    assert e.dtype == torch.float32
    assert bool(torch.isfinite(e).all() and (e > 0).all())
    assert float(e.max()) < 17 and float(e.min()) < 1e-9


def test_a_race_has_one_winner():
    """The smallest race time of a draw over 16,384 tokens is unique: a tie would go to the lower token
    id (argmax's first). With -log(u) of the 2^-23 grid, 0.2% of draws tie; here 2^-24 of them."""
    keys = Streams(range(1024), "cpu").bits(1, 0)
    ties = 0
    for k in keys.split(64):
        e = exponential(pcg_hash(k[:, None] ^ torch.arange(V_LLAMAGEN)))
        ties += int(((e == e.min(-1, keepdim=True).values).sum(-1) > 1).sum())
    assert ties == 0


def test_streams_uniform_and_normal_stay_finite_with_forced_bits():
    """Streams.bits(c1, .., ck) = hash(hash(..hash(key ^ c1) ^ .. ^ ck)): keys built to give its extremes."""
    for h in EXTREMES[::7] + [M32, TOP_ONES[-1]]:
        s = Streams([0], "cpu")
        s.key[:] = unhash(unhash(h)) ^ 3
        assert int(s.bits(3)[0]) == h
        u = float(s.uniform(3)[0])
        assert 0 < u < 1
        # normal(c) reads uniform(c, 0) and uniform(c, 1): force lane 0 to h
        s.key[:] = unhash(unhash(unhash(unhash(h))) ^ 3) ^ 5
        assert int(s.bits(5, 3, 0)[0]) == h
        assert bool(torch.isfinite(s.normal(5, 3)).all())


def draw(row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sample() of one distribution [V] under many keys, 256 at a time (a [K, V] race at V = 16,384)."""
    return torch.cat([sample(row.expand(len(k), -1), k) for k in keys.split(256)])


def _rows_with_zeros(V: int) -> torch.Tensor:
    """[5, V] distributions with zeros: one-hot at each end, two tokens, a spread of 20 (top-k 20), and
    mass on the first three quarters (too many tokens of mass for `sample` to race only those)."""
    p = torch.zeros(5, V)
    p[0, 0] = 1.0
    p[1, V - 1] = 1.0
    p[2, [3, V // 2]] = torch.tensor([1e-30, 1.0])
    p[3, torch.arange(20) * (V // 20)] = torch.softmax(torch.linspace(0, 5, 20), 0)
    p[4, :3 * V // 4] = torch.linspace(1.0, 2.0, 3 * V // 4)
    return p


@pytest.mark.parametrize("V", [4, 4096, V_LLAMAGEN])
def test_the_race_never_draws_a_zero_mass_token_whatever_its_bits(V):
    """For many zero-mass tokens of each row, a key that gives that token each extreme of the bits (the
    largest uniform: the smallest exponential time) must still lose to any token with mass."""
    p = _rows_with_zeros(V)
    g = torch.Generator().manual_seed(V)
    for r, row in enumerate(p):
        zero = (row == 0).nonzero()[:, 0]
        tokens = torch.unique(torch.cat([zero[:2], zero[-2:], zero[torch.randint(len(zero), (12,), generator=g)]]))
        keys = torch.tensor([key_giving(int(t), h) for t in tokens for h in EXTREMES])
        x = draw(row, keys)
        assert bool((row[x] > 0).all()), f"row {r}: drew zero-mass tokens {x[row[x] == 0].unique().tolist()}"


def full_race(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The race over the whole vocabulary, as sample() documents it: argmax_v p_v / E_v."""
    return (probs / exponential(pcg_hash(key[..., None] ^ torch.arange(probs.shape[-1])))).argmax(-1)


@pytest.mark.parametrize("V", [64, V_LLAMAGEN])
def test_the_race_over_the_tokens_of_mass_is_the_full_race(V):
    """sample() races only the tokens some row can draw where they are few: under any key, every row
    draws the token of the race over the whole vocabulary. Sparse rows, a one-hot row, tied masses, the
    tiniest normal mass, an empty row beside full ones (0, as the full race gives), a NaN mass (drawn,
    not hidden); and batches dense enough for the full race."""
    g = torch.Generator().manual_seed(V)
    sparse = torch.zeros(7, V)
    for r in range(3):
        sparse[r, torch.randperm(V, generator=g)[:max(2, V // 64)]] = torch.rand(max(2, V // 64), generator=g)
    sparse[3, V // 3] = 1.0                                          # one-hot
    sparse[4, [1, V - 2]] = 0.5                                      # tied
    sparse[5, [2, 9]] = torch.tensor([1e-38, 1e-38])                 # the tiniest normal masses
    nan = sparse.clone()
    nan[0, [V // 5, V // 7]] = float("nan")
    dense = torch.rand(4, V, generator=g) + 1e-3
    holes = dense.clone()
    holes[:, : V // 2] = 0.0                                         # half the vocabulary has no mass
    holes[2] = 0.0                                                   # an empty row among full ones
    for probs in (sparse, nan, dense, holes):
        keys = torch.randint(0, 2**32, (48, len(probs)), generator=g)
        keys[0] = M32
        keys[1] = 0
        expect = full_race(probs.expand(48, -1, -1), keys)
        assert torch.equal(sample(probs.expand(48, -1, -1), keys), expect)
    keys = torch.randint(0, 2**32, (48, 7), generator=g)
    assert bool((sample(sparse.expand(48, -1, -1), keys)[:, 6] == 0).all())          # the empty row


def test_the_race_gives_the_tiniest_mass_and_the_empty_row_a_valid_token():
    V = 64
    p = torch.zeros(V)
    p[17] = 1e-38                                                    # smallest normal float32
    keys = torch.tensor([key_giving(17, 0), key_giving(3, M32), key_giving(0, TOP_ONES[0])])
    assert sample(p.expand(3, -1), keys).tolist() == [17, 17, 17]
    empty = sample(torch.zeros(5, V), torch.tensor([0, 1, M32, key_giving(0, M32), 99]))
    assert bool(((empty >= 0) & (empty < V)).all())                  # an id to ignore, not an error


def _logits(V: int, rows: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 3
    x[0] = -1e4                                                      # one-hot-like: one huge gap
    x[0, 5] = 1e4
    x[1] = 0.0                                                       # all tied
    return x


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, top_k=1, top_p=1.0),                       # greedy by top-k
    dict(temperature=1.0, top_k=0, top_p=1e-6),                      # a top-p that keeps one token
    dict(temperature=1e-38, top_k=0, top_p=1.0),                     # temperature -> 0
    dict(temperature=1e-30, top_k=2000, top_p=0.9),
    dict(temperature=1e30, top_k=20, top_p=1.0),                     # huge temperature
    dict(temperature=0.0, top_k=0, top_p=1.0),                       # greedy
])
@pytest.mark.parametrize("V", [8, V_LLAMAGEN])
def test_filtered_distributions_are_finite_and_their_draws_have_mass(params, V):
    sp = SamplingParams(cfg_scale=1.0, **params)
    probs = filtered_probs(_logits(V), sp)
    assert bool(torch.isfinite(probs).all()), "NaN or inf in the distribution"
    assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    if params["top_k"] == 1 or params["top_p"] < 1e-3:
        # exactly one token of mass where the row has a single maximum (row 1 is all ties)
        assert ((probs[[0, *range(2, len(probs))]] > 0).sum(-1) == 1).all()
    zero_free = [int((row > 0).nonzero()[0]) for row in probs]
    # each row: keys that give its first zero-mass tokens the extreme bits
    for r, row in enumerate(probs):
        zero = (row == 0).nonzero()[:, 0][:8]
        if len(zero) == 0:
            continue
        keys = torch.tensor([key_giving(int(t), h) for t in zero for h in TOP_ONES[::8] + [M32]])
        x = draw(row, keys)
        assert bool((row[x] > 0).all()), (r, zero_free[r])


def test_a_draft_the_target_likes_as_much_passes_even_at_the_largest_uniform():
    """trial(): min(1, p/q) = 1 must pass for every u; p(x) = 0 must never pass, even with q(x) = 0
    (a one-hot draft scored against a target that excludes it)."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]] * 4)[None]        # [1, 4, V]
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])[None]
    x = torch.tensor([[1, 1, 3, 0]])
    u_max = unit(torch.tensor([[M32] * 4]))
    passed, fix = trial(p, q, x, u_max, torch.tensor([[key_giving(0, M32), key_giving(3, M32), 7, key_giving(4, M32)]]))
    assert passed.tolist() == [[True, True, False, False]]
    assert bool((p[0].gather(1, fix[0][:, None]) > 0).all())         # residual draws have mass
    # denormal masses: u q(x) rounds to q(x) for u just below 1; p >= q passes all the same
    tiny = torch.tensor([[[1e-40, 1.0 - 1e-40]]])
    assert trial(tiny, tiny, torch.tensor([[0]]), u_max[:, :1], torch.tensor([[0]]))[0].tolist() == [[True]]


def test_the_continuous_residual_sampler_reads_its_extreme_uniforms_safely():
    """log u is finite at both ends, so a try with c q < p is accepted at the smallest u and none with
    c q >= p at any u."""
    mu_p, sig_p = torch.zeros(2, 1), torch.ones(2, 1)
    mu_q, sig_q = torch.tensor([[3.0], [0.0]]), torch.ones(2, 1)
    normals = torch.tensor([[[-2.0], [0.0]], [[0.5], [1.0]]])         # [2, T=2, D=1]
    u = unit(torch.tensor([[0, M32], [0, M32]]))
    x, ok = residual_sample(mu_p, sig_p, mu_q, sig_q, torch.zeros(2), normals, u)
    assert ok.tolist() == [True, False] and x[0].tolist() == [-2.0]
    assert bool(torch.isfinite(x).all())


# -- the job's invariant over long runs of every engine -------------------------------------------------
DISCRETE = [("vanilla", {}), ("eagle2", dict(total_tokens=8, depth=3, width=3, budget="fixed", chain=0)),
            ("adt_tree", dict(budget="fixed", total_tokens=8, depth=2, width=2, d_min=1, d_max=4, w_min=1, w_max=3)),
            ("sjd", dict(chain=8)), ("mc_sjd", dict(chain=8)), ("mc_sjd", dict(chain=8, coupling="gumbel"))]


@pytest.fixture(scope="module")
def llamagen_vocab():
    """LlamaGen's 16,384 codes over 256 tokens, sharp enough that top-k 20 keeps a few codes of mass."""
    return tiny_bundle(vocab=V_LLAMAGEN, grid=16, dim=32, std=0.3, seed=3)


@pytest.mark.parametrize("name,kw", DISCRETE, ids=[n + ("_" + k.get("coupling", "")).rstrip("_") for n, k in DISCRETE])
def test_no_engine_commits_a_token_of_zero_target_mass(llamagen_vocab, name, kw):
    """8 prompts x 256 tokens, top-k 20 of 16,384 codes: 16,364 zero-mass codes at every draw. A sampler
    whose uniform reached 1.0 once in 2^24 commits one of them about once in 1,000 draws; these seeds'
    vanilla draws hold 7 such uniforms (a run of 2,048 draws holds 2 on average)."""
    sampling = dict(cfg_scale=2.0, temperature=1.0, top_k=20, top_p=1.0)
    engine = build_engine(llamagen_vocab, engine_config(name, sampling=sampling, **kw))
    results = engine.generate(labels(8), range(152, 160))
    assert sum(len(r.tokens) for r in results) == 8 * 256
    assert [r.invalid_tokens for r in results] == [0] * 8


@pytest.mark.parametrize("name,kw", [("mar", dict(num_iter=8)), ("cspd", dict(num_iter=8, num_draft=4, lam=1.0)),
                                     ("cspd", dict(num_iter=8, num_draft=4))], ids=["mar", "cspd_exact", "cspd"])
def test_no_continuous_engine_commits_a_non_finite_token(name, kw):
    """The continuous analogue: every token vector finite, and every drafted token's log acceptance ratio."""
    from tests.test_cspd import bundle, tiny_mar
    b = bundle(tiny_mar(0), tiny_mar(1))
    results = build_engine(b, engine_config(name, **kw)).generate(b.conditions([str(i % 5) for i in range(8)]),
                                                                  range(8))
    assert [r.invalid_tokens for r in results] == [0] * 8
    if name == "cspd":
        assert sum(int((r.records["window_pos"] >= 0).sum()) for r in results) > 0   # drafts were checked


def test_the_invariant_counts_what_it_names():
    """ImageResult.invalid_tokens on hand-made records: zero or NaN target mass; a non-finite vector or a
    drafted token's non-finite log ratio."""
    from decoding.engines.base import ImageResult
    img = np.zeros((1, 1, 3), np.uint8)
    p = np.array([0.5, 0.0, np.nan, 1e-30], np.float32)
    assert ImageResult(np.arange(4), img, {"p_target": p}, 4, 0, 0.0).invalid_tokens == 2
    vec = np.zeros((4, 2), np.float32)
    vec[1, 0] = np.inf
    rec = {"window_pos": np.array([-1, -1, 0, 1]), "log_accept_ratio": np.array([np.nan, np.nan, np.nan, 0.1], np.float32)}
    assert ImageResult(vec, img, rec, 4, 0, 0.0).invalid_tokens == 2            # the inf row and the NaN draft
