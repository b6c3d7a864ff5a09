"""A stream regroups its rows (base.SlotEngine.stream): when no request waits and at most half the rows
are busy, the busy rows continue in a batch of half as many rows (or a quarter, ...), and the batch
grows back when requests come. Every row of a batch is computed, busy or not, so without it the last
rows of a stream pay for all of them. A regrouped row must keep its own K/V (both CFG halves), random
stream, token log and, in the tree engines, its drafter state and chain: any of them lost changes the
tokens, which must stay vanilla's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.engines import build_engine, engine_config
from decoding.engines.base import CachedModel
from decoding.engines.requests import Request, RequestQueue
from decoding.engines.cost import measure
from tests.conftest import COSTS, labels, tiny_bundle
from tests.test_budget import SAMPLING, TREES, alternate
from tests.test_chain import mixed

# tree engines at refill 0 (a free row takes the next prompt at once): rows finish apart and regroup from anywhere
CASES = {"vanilla": ({}, None),
         "eagle2": (dict(TREES["eagle2"], budget="fixed"), [0, 3, 0, 6, 8]),
         "adt_tree": (dict(TREES["adt_tree"], budget="fixed"), [0, 3, 0, 6, 8]),
         "adt_tree_chains": (dict(total_tokens=6, chain=5, costs=COSTS), None),
         "mc_sjd": (dict(chain=4), None), "sjd": (dict(chain=2, init="repeat"), None)}


def setup(case):
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    kw, pattern = CASES[case]
    engine = build_engine(bundle, engine_config(case.replace("_chains", ""), sampling=SAMPLING, **kw))
    if case != "vanilla":
        engine.refill = 0
        engine.planner.room = lambda st: (None, True)   # no hold from the measured width cost: the plan runs
    if case.endswith("chains"):
        mixed(engine, [1, 0, 1, 0, 0], [0, 4])                           # chain, tree and plain steps
    elif pattern:
        alternate(engine, pattern)
    rows, keeps, forward, resize = [], [], engine.gpt.forward_embeds, engine.resize
    engine.gpt.forward_embeds = lambda h, *a, **k: rows.append(h.shape[0]) or forward(h, *a, **k)
    engine.resize = lambda st, keep, slots: keeps.append(list(keep)) or resize(st, keep, slots)
    return bundle, engine, rows, keeps


def vanillas(bundle, seeds):
    engine = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING))
    return [engine.generate(labels(1), [s])[0].tokens.tolist() for s in seeds]


@pytest.mark.parametrize("case", list(CASES))
def test_the_rows_left_at_the_end_of_a_stream_regroup_and_keep_their_images(case):
    """Tokens are vanilla's (the exact-token engines), and every record of every token (the token, the step,
    accepted drafts, tree shape, budget, draft and target probabilities, forwards) is what the same stream
    logs without regrouping: a row's drafter state, tree policy, chain or Jacobi window went with it."""
    seeds = [500 + i for i in range(6)]
    runs = {}
    for regroup in (False, True):
        bundle, engine, rows, keeps = setup(case)
        engine.regroups = regroup
        requests = (Request(c, s, key=i) for i, (c, s) in enumerate(zip(labels(6).split(), seeds)))
        outs = list(engine.stream(requests, slots=4))
        assert not any(o.error for o in outs), [o.error for o in outs if o.error]
        runs[regroup] = {o.key: o.result for o in outs}
    if case not in ("sjd", "mc_sjd"):                                    # (Jacobi: vanilla's law, not its tokens)
        assert {k: r.tokens.tolist() for k, r in runs[True].items()} == dict(enumerate(vanillas(bundle, seeds)))
    assert keeps and min(rows) < 8                                       # steps ran over fewer than 4 x 2 rows
    if case != "vanilla":                                                # (vanilla's rows finish together)
        assert any(k != list(range(len(k))) for k in keeps)             # rows moved to other rows
    for key, got in runs[True].items():
        want = runs[False][key]
        assert (got.target_forwards, got.draft_forwards) == (want.target_forwards, want.draft_forwards)
        for col, values in want.records.items():
            np.testing.assert_allclose(got.records[col], values, rtol=1e-5, err_msg=f"prompt {key}: {col}")


@pytest.mark.parametrize("case", ["vanilla", "adt_tree_chains"])
def test_a_regrouped_batch_grows_back_when_requests_come(case):
    """An actor's queue runs dry between parts: the batch regroups into fewer rows, and the next part's
    prompts regroup it back to `slots` rows at once."""
    bundle, engine, rows, keeps = setup(case)
    seeds = [200 + i for i in range(5)]
    conds = labels(5).split()
    queue = RequestQueue()
    queue.put([Request(conds[i], seeds[i], key=i) for i in range(2)])
    step, put = engine.step, []

    def later(st):                                                       # the next part, once regrouped
        if st.slots < 4 and not put:
            put.append(1)
            queue.put([Request(conds[i], seeds[i], key=i) for i in range(2, 5)])
            queue.close()
        step(st)
    engine.step = later
    outs = list(engine.stream(queue, slots=4))
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    assert {o.key: o.result.tokens.tolist() for o in outs} == dict(enumerate(vanillas(bundle, seeds)))
    shrunk = rows.index(4)                                               # 2 prompts x CFG
    assert 8 in rows[shrunk:]                                            # and back to 4 x 2 rows


def test_while_requests_wait_the_batch_keeps_its_rows():
    """Regrouping is for the end of a stream: rows that finish while prompts wait, or while the batch
    waits to restart together (TreeEngine.refill), stay in the batch and take the next prompts."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, **dict(TREES["eagle2"], budget="fixed")))
    alternate(engine, [0, 3, 0, 6, 8])
    events, admit, resize = [], engine.admit, engine.resize
    engine.admit = lambda st, rows, *a: events.append("admit") or admit(st, rows, *a)
    engine.resize = lambda st, keep, slots: events.append("regroup") or resize(st, keep, slots)
    outs = list(engine.stream((Request(c, i, key=i) for i, c in enumerate(labels(12).split())), slots=4))
    assert len(outs) == 12 and not any(o.error for o in outs)
    assert "regroup" in events and events.index("regroup") > max(i for i, e in enumerate(events) if e == "admit")


def test_measuring_a_new_batch_shape_leaves_the_engines_cache_alone():
    """An engine that regroups into a batch shape the cost table lacks measures it mid-stream
    (cost.measure), which sets up caches of its own: the engine's K/V must survive it."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    cache = CachedModel(bundle.gpt, 4, 40, torch.float32)
    for c in bundle.gpt.caches():
        c.k.normal_(), c.v.normal_()
    before = [(c, c.k.clone(), c.v.clone()) for c in bundle.gpt.caches()]
    measure(bundle, rows=(2,), reps=1)
    assert [c for c in bundle.gpt.caches()] == [c for c, _, _ in before]
    assert all(torch.equal(c.k, k) and torch.equal(c.v, v) for c, k, v in before)
    assert CachedModel(bundle.gpt, 2, 40, torch.float32) and bundle.gpt.caches()[0] is before[0][0]  # reused
    assert cache.valid.shape == (4, 40)


def test_a_state_tensor_that_does_not_say_how_it_follows_its_row_is_refused_at_a_regroup():
    """Regrouping copies every field of a state as it declares (state.py); a tensor that declares nothing
    would be left behind silently, so it fails, naming the field."""
    from dataclasses import dataclass

    from decoding.engines.vanilla import VanillaState

    @dataclass
    class Extra(VanillaState):
        extra: torch.Tensor | None = None

    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING))
    start = engine.start
    engine.start = lambda slots: Extra(**vars(start(slots)), extra=torch.zeros(slots))
    with pytest.raises(TypeError, match="Extra.extra"):
        engine.resize(engine.start(4), [1, 2], 2)


def test_an_image_reports_the_batch_it_actually_ran_in():
    """ImageResult.batch (the images table's batch_size): the mean slots over the steps an image took
    part in. Prompts that finish while the batch is full ran at 8; the last ones ran part of their
    steps in a regrouped batch of fewer rows."""
    engine = setup("vanilla")[1]
    outs = list(engine.stream([Request(c, i, i) for i, c in enumerate(labels(12).split())], slots=8))
    batch = [o.result.batch for o in outs]
    assert max(batch) == 8 and min(batch) < 8 and all(1 <= x <= 8 for x in batch), batch


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_of_a_state_declares_the_rows_its_shape_has(case):
    """A regroup moves what a state's fields declare (state.py): a field whose first dimension is the
    batch's slots must be per slot, one whose first is its cache rows per cache row, and nothing per row may
    be carried as it is (it would keep the old batch's rows in the new one). Checked on every field of a
    3-slot batch after a prompt was admitted and a step ran."""
    from dataclasses import fields

    from decoding.engines.state import CACHE, CARRY, SLOT
    bundle, engine, _, _ = setup(case)
    st = engine.start(3)
    engine.admit(st, torch.tensor([1]), labels(1), [7])
    engine.step(st)
    per = 2 if engine.sampling.use_cfg else 1
    for f in fields(st):
        value, kind = getattr(st, f.name), f.metadata.get("rows")
        rows = len(value) if torch.is_tensor(value) and value.dim() else getattr(value, "slots", None)
        if hasattr(value, "valid"):                                     # a CachedModel
            rows = value.valid.shape[0]
        if kind == SLOT:
            assert rows in (3, None), (f.name, rows)
        elif kind == CACHE:
            assert rows in (3 * per, None), (f.name, rows)
        else:
            assert not torch.is_tensor(value) and not hasattr(value, "copy_rows"), (f.name, kind)
            assert kind != CARRY or isinstance(value, (int, float)), f.name
