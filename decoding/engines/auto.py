"""`engine=auto`, the job's default: the lossless engine this project is for, chosen from what the model
has (docs/design.md, "engine=auto").

- a discrete model with a drafter: ADT-Tree with its chain steps (tree.py), each step plain, chain or a
  drafter tree as the cost table prices them;
- a discrete model without one (a public LlamaGen checkpoint): the same engine with no drafter trees
  (engine.total_tokens=0): chains of the target's own draws and plain steps, no draft forward at all;
- a continuous model: MAR's own sampling (engine=mar); CSpD stays a choice (engine=cspd).

Every discrete choice verifies with exact acceptance, so its tokens are vanilla's (in fp32, the very
tokens; tests/test_auto.py), and where the cost table says speculation does not pay, every step is a
plain step: vanilla's forward and draw.
"""
from __future__ import annotations

from dataclasses import dataclass

from decoding.engines.base import EngineConfig


@dataclass
class AutoConfig(EngineConfig):
    name: str = "auto"
    # a cost table to decide from (as the tree engines' engine.costs); empty: measured once on the device
    costs: str = ""

    def validate(self) -> None:
        super().validate()
        if self.costs:
            from decoding.engines.cost import given
            given(self.costs)                # a table that cannot be read fails here, before any actor loads


def resolve(cfg: AutoConfig, tokens: str, has_drafter: bool) -> EngineConfig:
    """The settings of the engine `engine=auto` runs for a model of `tokens` ("discrete" or "continuous")
    with or without a drafter."""
    from decoding.engines import engine_config
    if tokens == "continuous":
        if cfg.costs:
            raise ValueError("engine.costs: engine=auto runs engine=mar on a continuous model, which has no cost "
                             "table; leave engine.costs empty")
        return engine_config("mar", sampling=cfg.sampling)
    return engine_config("adt_tree", sampling=cfg.sampling, costs=cfg.costs,
                         **({} if has_drafter else {"total_tokens": 0}))


class Auto:
    """Not an engine of its own: `Auto(bundle, cfg)` builds the engine `resolve` picks for the bundle."""
    name, Config, uses_drafter = "auto", AutoConfig, False

    @classmethod
    def check(cls, cfg: AutoConfig, has_drafter: bool, tokens: str = "discrete") -> None:
        cfg.validate()
        resolve(cfg, tokens, has_drafter)                  # (engine_config validates what it picks)

    def __new__(cls, bundle, cfg: AutoConfig):
        from decoding.engines import build_engine
        tokens, drafter = getattr(bundle, "tokens", "discrete"), getattr(bundle, "drafter", None)
        return build_engine(bundle, resolve(cfg, tokens, drafter is not None))
