"""Engines by name. Each engine class carries its settings dataclass (`Engine.Config`), the one place
its defaults are written; `build_engine(bundle, cfg)` makes the engine `cfg.name` names."""
from __future__ import annotations

from dataclasses import fields, is_dataclass

from decoding.engines.auto import Auto
from decoding.engines.base import Engine, EngineConfig, ImageResult
from decoding.engines.cspd import CSpD
from decoding.engines.mar import ContinuousEngine, Mar
from decoding.engines.jacobi import MCSJD, SJD
from decoding.engines.tree import ADTTree, Eagle2
from decoding.engines.vanilla import Vanilla
from decoding.sampling import SamplingParams

ENGINES: dict[str, type] = {e.name: e for e in (Auto, Vanilla, Eagle2, ADTTree, SJD, MCSJD, Mar, CSpD)}


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r} is not an engine: choose one of {sorted(ENGINES)}")
    return ENGINES[name]


def engine_config(name: str, **settings) -> EngineConfig:
    """The settings of engine `name` from keyword values (`sampling` may be a dict): for code and tests
    that do not go through Hydra. An unknown key is refused, as the job's schema refuses it."""
    cls = engine_class(name).Config
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"engine.{unknown[0]}: engine {name!r} has no such setting; its settings are "
                         f"{', '.join(sorted(known - {'name'}))}")
    if isinstance(settings.get("sampling"), dict):
        settings["sampling"] = SamplingParams(**settings["sampling"])
    cfg = cls(**settings)
    cfg.validate()
    return cfg


def check_tokens(name: str, tokens: str, model: str) -> None:
    """Engine `name` can serve a model whose tokens are `tokens` ("discrete" or "continuous"), or one
    ValueError line (the driver checks it from the model family, build_engine from the bundle)."""
    if name == Auto.name:
        return                                             # it picks an engine for either
    if tokens == "continuous" and not issubclass(engine_class(name), ContinuousEngine):
        raise ValueError(f"engine={name} samples discrete tokens and model {model!r} makes continuous ones: "
                         f"use engine=mar or engine=cspd, or a discrete model (model=shapes)")
    if tokens != "continuous" and issubclass(engine_class(name), ContinuousEngine):
        raise ValueError(f"engine {name!r} samples continuous tokens and model {model!r} is discrete: "
                         f"use model=mar (the continuous shapes models, or MAR checkpoints)")


def check_engine(cfg: EngineConfig, tokens: str, has_drafter: bool, model: str, seq_len: int | None = None) -> None:
    """Every refusal of engine settings `cfg` for a model that needs no weights (the job's driver, from the
    model family and the checkpoint headers: `seq_len`, the model's tokens per image, where they say it),
    as one ValueError line."""
    check_tokens(cfg.name, tokens, model)
    cls = engine_class(cfg.name)
    if cls is Auto:
        cls.check(cfg, has_drafter, tokens)
        return
    cls.check(cfg, has_drafter)
    if seq_len is not None:
        cls.fits(cfg, seq_len)


def build_engine(bundle, cfg: EngineConfig) -> Engine:
    """The engine `cfg.name` over `bundle` (settings validated, sampling defaults from the bundle)."""
    if not is_dataclass(cfg):
        raise TypeError(f"build_engine takes an engine config dataclass, not {type(cfg).__name__}")
    check_tokens(cfg.name, getattr(bundle, "tokens", "discrete"), bundle.name)
    return engine_class(cfg.name)(bundle, cfg)


__all__ = ["ENGINES", "Engine", "EngineConfig", "ImageResult", "SamplingParams", "build_engine", "check_engine", "check_tokens",
           "engine_class", "engine_config"]
