"""Discrete engines by name. Each takes (bundle, SamplingParams, **its own settings)."""
from __future__ import annotations

import inspect
from dataclasses import fields

from decoding.engines.base import Engine, ImageResult
from decoding.engines.tree import ADTTree, Eagle2
from decoding.engines.vanilla import Vanilla
from decoding.sampling import SamplingParams

ENGINES = {e.name: e for e in (Vanilla, Eagle2, ADTTree)}


def engine_settings(cls) -> set[str]:
    """Keyword settings an engine class accepts (its own and its parents')."""
    names = set()
    for klass in cls.__mro__[:-1]:  # not object
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD} - {"self", "bundle", "sampling"}
    return names


def build_engine(bundle, settings: dict) -> Engine:
    """Engine `settings["name"]` with the sampling parameters and the engine settings it takes from one
    flat dict (the job's `engine` config serves every engine)."""
    name = settings.get("name")
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r} is not an engine: choose one of {sorted(ENGINES)}")
    cls = ENGINES[name]
    sampling = SamplingParams(**{f.name: settings[f.name] for f in fields(SamplingParams) if f.name in settings})
    accepted = engine_settings(cls)
    return cls(bundle, sampling, **{k: v for k, v in settings.items() if k in accepted})


__all__ = ["ENGINES", "Engine", "ImageResult", "SamplingParams", "build_engine"]
