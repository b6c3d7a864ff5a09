"""How many draft tokens a step verifies (K nodes per row; K = 0: a plain step, vanilla's): the choice that
maximises committed tokens per second for this batch on this device (docs/design.md, "Budgets").

The cost model proposes: tokens(K) = 1 + v_1 + ... + v_K per row (v_k: how often a row's k-th best node
is accepted) over time(K) = draft(K) + target(R, 1 + K) + overhead, from the cost table (cost.py). Goodput
disposes: per R, what plain steps and each bucket of K actually committed per ms of the step's price (the
engine prices each step from the cost table, never the clock). `plan` follows the rule in docs/design.md
("The budget's rule"): measure the floor, step down past buckets measured below MARGIN x plain, probe
back with a doubling back-off. `choose` then picks K <= plan from the rows' drafted candidates.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from decoding.engines.cost import CostTable

EMA = 0.9
SPEC_EMA = 0.5   # a speculative bucket's rate follows the image: one bad step outweighs half the past
PLAIN_LAST = 5   # the plain rate is the median of the last plain steps: it follows the rows' positions
                 # (when a batch restarts, steps halve in cost at once, and a slow EMA of the last image's
                 # steps made the next probe look like a win) but not one outlier step
MARGIN = 1.1     # speculation must beat the plain rate by 10% to be taken, or to reset the back-off: one
                 # step's time is noisy, and a false "it pays" costs a run of slower steps
PROBE_MIN, PROBE_MAX = 4, 1024   # plain steps before speculation is probed again (doubling on each failure)
PROBE_SHARE = 0.005  # at most this share of the steps lost to probes that fail: a failed probe that lost x
                     # plain steps waits x / PROBE_SHARE (docs/measurements.md, "Budget constants")
PROBE_RUN = 3    # speculative steps a probe takes, judged together: the first one pays the drafter's catch-up
                 # on the plain stretch before it, which speculation that pays pays once per run
CHAIN_RUN = 8    # a chain's probe: its first steps verify drafts copied from the row above, its later ones the
                 # target's own draws, which is where a chain pays; the whole run is judged
CHAIN_EMA = 0.9  # a chain's rate follows the image more slowly than a tree's: a chain step commits all of it
                 # (9 tokens at batch 1) or one token, by stretches, and a fast EMA switched it off in every
                 # busy stretch, and the back-off kept it off through the flat ones that followed
CONFIDENT = 0.9  # a plain stretch whose least confident row drew its last tokens at target probability >= this
                 # on average probes at once where speculation has paid (the mean probability of the token
                 # drawn estimates Σp², the chance a draft of it is accepted)
FLOOR_SAMPLES, FLOOR_EVERY = 2, 32  # plain steps measured first, and then at least one per FLOOR_EVERY steps


def _median(xs) -> float:
    """Median of a few floats (numpy's costs more than the rest of a plan)."""
    s = sorted(xs)
    return float(s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)


def bucket(K: int) -> int:
    """0 for a plain step; 1, 2, 3, 4, ... for K = 1, 2, 3-4, 5-8, ..."""
    return 0 if K <= 0 else int(K - 1).bit_length() + 1


@dataclass
class Goodput:
    """Measured committed tokens per unfinished row per ms, by bucket (0 = plain), for one R."""
    rate: dict = field(default_factory=dict)     # 0 -> tokens / row / ms; b > 0 -> that over plain's
    seen: dict = field(default_factory=dict)     # bucket -> step of its last measurement
    plain_n: int = 0                             # plain steps measured
    step: int = 0                                # steps planned
    last_spec: int = 0                           # step of the last speculative step
    wait: int = PROBE_MIN                        # steps between probes
    probing: bool = False                        # this step is a probe
    run: int = 0                                 # probe steps left after this one
    run_K: int = 0                               # the probe's K
    lost: float = 0.0                            # plain steps the probe's run has lost so far
    net: float = 0.0                             # plain steps speculation has gained in all (< 0: lost)
    recent: deque = field(default_factory=lambda: deque(maxlen=PLAIN_LAST))   # the last plain steps' rates
    ema: float = SPEC_EMA                        # a speculative bucket's EMA weight per step (CHAIN_EMA for chains)

    def update(self, b: int, rate: float) -> None:
        """rate[0] is the plain step's tokens / row / ms (the median of the last PLAIN_LAST); rate[b > 0] a
        speculative bucket's rate over the plain rate at the time it was measured. Relative, because
        steps of both kinds slow down alike as the rows' positions grow (attention reads every row up to
        the longest): an absolute rate measured early
        in an image beat a plain rate measured late and turned speculation on for nothing. A speculative
        bucket's estimate ages with the steps since it was measured (the image changes)."""
        if b == 0:
            self.recent.append(rate)
            self.rate[0], self.seen[0] = _median(self.recent), self.step
            self.plain_n += 1
            return
        if 0 not in self.rate:
            return
        old = self.ema ** (self.step - self.seen[b]) if b in self.rate else 0.0
        self.rate[b] = old * self.rate.get(b, 0.0) + (1 - old) * rate / self.rate[0]
        self.seen[b] = self.step

    def below_plain(self, b: int) -> bool:
        """Measured, and not clearly better than a plain step (by MARGIN)."""
        return b in self.rate and self.rate[b] < MARGIN


class Budget:
    def __init__(self, costs: CostTable | None, max_nodes: int, width: int, chain: int = 0):
        """A budget of tree steps: K = 1..max_nodes drafter nodes, drafted `width` wide. Or, given `chain`,
        of chain steps (proposers.py `ChainProposer`): K = 1 is a chain of `chain` tokens the target drew itself,
        verified with no drafter, and v_1 the drafts such a step commits.

        One length: a chain is worth what the steps before it drew (a draw at node k becomes the next
        chain's draft), so a shorter chain also makes the next ones worse, which no per-step value can
        see (docs/measurements.md, "Budget constants")."""
        self.chain = chain
        self.kind = "chain" if chain else "spec"            # the cost table's name for its steps' overhead
        max_nodes = 1 if chain else max_nodes
        self.costs, self.max, self.width = costs, max_nodes, width
        self.verified = np.array([chain] if chain else range(1, max_nodes + 1))  # draft tokens a step of K verifies
        self.prior = 0.8 ** np.arange(1, max_nodes + 1)     # v_k before anything was observed
        self.value = self.prior.copy()
        self.calibration = 1.0                               # accepted / drafter's path probability
        self.measured: dict[int, Goodput] = {}               # R -> what the steps achieved
        self._curve: dict = {}                               # (R, pending) -> forward ms of K = 0..max
        self._spec: dict = {}                                # (R, pending) -> _spec_rates, and what it came from

    @property
    def fixed(self) -> bool:
        return self.costs is None

    def forward_ms(self, R: int, pending: int) -> np.ndarray:
        """Forward ms of a step with K = 0..max nodes (0: the plain step's one target forward)."""
        key = (R, pending)
        if key not in self._curve:
            c, K = self.costs, np.arange(1, self.max + 1)
            spec = np.array([c.target(R, 1 + k) for k in self.verified])
            if not self.chain:                               # level 1 comes from the catch-up
                spec = spec + c.drafter(R, max(pending, 1)) + np.maximum(K - 1, 0) * c.drafter(R, self.width)
            self._curve[key] = np.concatenate([[c.target(R, 1)], spec])
        return self._curve[key]

    def _spec_rates(self, R: int, pending: int) -> tuple[np.ndarray, int]:
        """The cost model's expected tokens per row per ms for K = 1..max [max], and its best K. Kept
        until the acceptance changes (only speculative steps change it)."""
        o = self.costs.overhead(self.kind, R)
        token = (o, self.value.tobytes())
        hit = self._spec.get((R, pending))
        if hit is None or hit[0] != token:
            rates = (1 + np.cumsum(self.value)) / (self.forward_ms(R, pending)[1:] + o)
            hit = self._spec[(R, pending)] = (token, rates, int(np.argmax(rates)) + 1)
        return hit[1], hit[2]

    def model_rates(self, R: int, pending: int) -> np.ndarray:
        """The cost model's expected tokens per row per ms for K = 0..max (0: a plain step)."""
        plain = 1.0 / (float(self.forward_ms(R, pending)[0]) + self.costs.overhead("plain", R))
        return np.concatenate([[plain], self._spec_rates(R, pending)[0]])

    def model_plan(self, R: int, pending: int) -> int:
        """The cost model's own choice of K (0: plain), before any measured goodput."""
        return int(np.argmax(self.model_rates(R, pending)))

    def goodput(self, R: int) -> Goodput:
        g = self.measured.get(R)                             # (setdefault would build a Goodput every call)
        if g is None:
            g = self.measured[R] = Goodput(ema=CHAIN_EMA if self.chain else SPEC_EMA)
        return g

    def plan(self, R: int, pending: int, confidence=None) -> int:
        """K to draft for this step (0: a plain step). R cache rows, `pending` the longest catch-up the
        drafter would need first (an upper bound will do); `confidence`: a callable giving the least
        confident row's recent mean target probability, called only when it could start a probe. The
        rule is the module docstring's."""
        if self.fixed:
            return self.max
        g = self.goodput(R)
        g.step += 1
        g.probing = False
        if g.plain_n < FLOOR_SAMPLES or g.step - g.seen[0] > FLOOR_EVERY:
            return 0                                         # 1. measure the floor
        if g.run > 0:                                        # 3. a probe's next step
            g.run, g.probing = g.run - 1, True
            return g.run_K
        K, best = self._choice(R, pending)                   # 2.
        since = g.step - g.last_spec
        g.probing = K == 0 and (since >= g.wait or (g.net > 0 and since >= PROBE_MIN and confidence is not None
                                                    and confidence() >= CONFIDENT))
        if g.probing:
            g.run, g.run_K, g.lost = (CHAIN_RUN if self.chain else PROBE_RUN) - 1, best, 0.0
        return best if g.probing else K                      # 3. probe

    def _choice(self, R: int, pending: int) -> tuple[int, int]:
        """Rule 2 of the module docstring, without probes: (K, the model's best K). A function of what
        was measured and learnt, and of `pending`."""
        g = self.goodput(R)
        rates, best = self._spec_rates(R, pending)
        K = best                                             # the model's best tree
        while K > 0 and g.below_plain(bucket(K)):            # step down past buckets measured worse
            K = 2 ** (bucket(K) - 2) if bucket(K) > 1 else 0
        if K > 0 and bucket(K) not in g.rate and rates[K - 1] < MARGIN * self.model_rates(R, pending)[0]:
            K = 0                                            # unmeasured: the model's word, with the margin
        return K, best

    def admit(self, R: int) -> None:
        """A new prompt entered the batch. Where speculation has paid at this R, the probe back-off starts
        over: a new image is new content, and the back-off a hard image built (up to PROBE_MAX) kept the
        next images plain (at batch 1, run three times over 16 prompts, speculative steps fell from 292 in
        the first round to 53 and 5). Where it has only lost, the back-off stands (at batch 8-16 a prompt
        arrives every few dozen steps)."""
        if self.fixed:
            return
        g = self.goodput(R)
        if g.net > 0:
            g.wait = PROBE_MIN

    def quiet(self, R: int, pending: int) -> int:
        """After a plain step that was no probe: how many of the next steps are certain to be plain, so
        that the engine may take them without planning, `_room` or `observe` (each a `hold`). `pending`
        must be what the drafter's catch-up will stay at (the engine's cap), so that rule 2 gives the same
        answer at every step. Where speculation has only lost at this R (no confidence cue), the floor is
        measured and rule 2 says plain, no plain step's measurement changes the plan before the next probe
        is due: every step up to PLAIN_LAST before it is quiet (those keep the plain rate the probe is
        judged by fresh)."""
        if self.fixed:
            return 0
        g = self.goodput(R)
        if g.probing or g.run or g.net > 0 or g.plain_n < FLOOR_SAMPLES or self._choice(R, pending)[0]:
            return 0
        return max(g.last_spec + g.wait - g.step - 1 - PLAIN_LAST, 0)

    def hold(self, R: int) -> int:
        """A plain step the engine takes whatever the plan (no row may speculate, tree.py `_room`): it
        counts as a step, and it is no probe."""
        if not self.fixed:
            g = self.goodput(R)
            g.step += 1
            g.probing = False
        return 0

    def choose(self, R: int, values: torch.Tensor, plan: int, drafted_ms: float) -> int:
        """K <= plan for the verify forward. values [B, C]: each unfinished row's candidate nodes valued by
        path probability, best first (0 for finished rows and padding); drafted_ms: drafting already spent."""
        plan = min(plan, values.shape[1])                   # a shallow or narrow tree has fewer nodes
        if self.fixed:
            return plan
        v = values[:, :plan].float().sum(0).cpu().numpy() * self.calibration     # Σ over rows of the k-th best
        prompts = int((values[:, 0] > 0).sum())
        gain = prompts + np.concatenate([[0.0], np.cumsum(v)])
        c, o = self.costs, self.costs.overhead(self.kind, R)
        rate = [gain[K] / (drafted_ms + c.target(R, 1 + K) + o) for K in range(plan + 1)]
        return int(np.argmax(rate))

    def observe(self, R: int, planned: int, step_ms: float, tokens_per_row: float = 1.0,
                accepted_by_rank: np.ndarray | None = None, predicted: float = 0.0, accepted: float = 0.0,
                catch_up_ms: float = 0.0, behind: float | None = None) -> None:
        """A step planned with K = `planned` (0: plain) over R rows cost step_ms by the cost table (the
        engine's price of what it ran), of which catch_up_ms were the drafter's catch-up; it committed
        tokens_per_row per unfinished row. accepted_by_rank [K]: the mean acceptance of each rank's node
        over the rows; predicted / accepted: Σ of the verified nodes' path probabilities and the drafts
        accepted over the unfinished rows (the calibration).

        behind: the Σ of verified path probabilities of the rows furthest from done (the fewest tokens),
        on average. Where given, the step's goodput counts the tokens the drafts were worth to those
        rows, 1 + calibration x behind, not the tokens_per_row this one step happened to commit:
        - what the drafts were worth, because an accepted length ranges over 1..depth + 1 from one step
          to the next, and one unlucky probe used to mark a bucket below plain for hundreds of steps
          (the drafter's path probabilities, calibrated on every step, still follow the image);
        - to the rows furthest behind, because a batch takes as many steps as its slowest row, and a row
          that runs ahead waits for it at the end of its image (TreeEngine.refill).

        catch_up_ms: the drafter's catch-up in this step. A probe's run ends at once when the step is too
        slow to beat a plain step even without it: the run is there to spread the catch-up on the plain
        stretch before it, and nothing else in a step gets cheaper with the run."""
        if self.fixed:
            return
        g = self.goodput(R)
        worth = tokens_per_row if behind is None else 1 + self.calibration * behind
        b, rate = bucket(planned), worth / max(step_ms, 1e-6)
        if b > 0 and 0 in g.rate and not g.probing and rate >= MARGIN * g.rate[0]:
            g.wait = PROBE_MIN                               # speculation pays: probe again soon when it stops
        if b > 0 and 0 in g.rate:
            gained = worth - step_ms * g.rate[0]             # over what plain steps commit in that time
            g.net += gained
            if g.probing:
                g.lost -= gained
        if b > 0:
            g.last_spec = g.step
        g.update(b, rate)
        if b > 0 and g.probing and g.run > 0 and 0 in g.rate and not self.chain and \
                worth / max(step_ms - catch_up_ms, 1e-6) < MARGIN * g.rate[0]:
            g.run = 0                                        # it loses without the catch-up too: end the run
        if b > 0 and g.probing and g.run == 0 and 0 in g.rate:   # a probe's last step: judge the run
            g.wait = PROBE_MIN if not g.below_plain(b) else \
                int(min(max(2 * g.wait, 0 if g.net > 0 and not self.chain else g.lost / PROBE_SHARE), PROBE_MAX))
        if accepted_by_rank is not None and len(accepted_by_rank):
            k = len(accepted_by_rank)
            self.value[:k] = EMA * self.value[:k] + (1 - EMA) * accepted_by_rank
            self.value[k:] = np.minimum(self.value[k:], self.value[k - 1])  # a rank never beats the one above
        if predicted > 0:
            self.calibration = EMA * self.calibration + (1 - EMA) * min(accepted / predicted, 2.0)

    def ceiling(self, R: int) -> float:
        """What this device allows: the best speedup over a plain step any tree of <= max nodes could give
        with the acceptance learnt so far (v_k) and the measured forward costs, counting no overhead
        beyond the forwards (an ideal implementation; catch-up of one pair)."""
        if self.fixed:
            return float("nan")
        forwards = self.forward_ms(R, 1)                      # a catch-up of one pair
        return float(np.max((1 + np.cumsum(self.value)) / forwards[1:]) * forwards[0])
