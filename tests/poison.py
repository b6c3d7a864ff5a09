"""Generator actors that misbehave on purpose: one dies, as a segfault or an OOM kill would end it,
whenever its batch holds the prompt id "poison" (tests/test_job.py); one is slow on one batch. Shipped
to Ray's workers by value (ray.cloudpickle), so that they need not import the tests package."""
from __future__ import annotations

import os
import time

from actors.generator import Generator


class PoisonedGenerator(Generator):
    def run(self, part, items):
        if any(it["prompt_id"] == "poison" for it in items):
            os._exit(1)
        return super().run(part, items)


class CrampedGenerator(Generator):
    """A generator actor on a device with 100 kB free (tests/test_reliability.py): the memory check
    sized by the model's dims, with the device's free memory injected."""
    def free_memory(self) -> int:
        return 100_000


class SlowGenerator(Generator):
    """A generator actor that takes 2 s more over the batch holding the prompt id "slow", as a busy node
    would (tests/test_job.py: the job's steps must not depend on it)."""
    def run(self, part, items):
        if any(it["prompt_id"] == "slow" for it in items):
            time.sleep(2.0)
        return super().run(part, items)
