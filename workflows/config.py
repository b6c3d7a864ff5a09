"""Structured config of the generate job (Hydra): dataclass schemas, YAML groups in conf/.

The `engine` and `model` groups take their schemas from decoding/ (each engine's and each model
family's settings dataclass, the only place their defaults are written): conf/engine/*.yaml and
conf/model/*.yaml only pick one and note what they change. Hydra then refuses a key the chosen engine
does not have, or a value of the wrong type, before anything runs; `cli` turns that refusal, and every
ConfigError, into one line.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# `${arspec_conf:data/samples/parti64.tsv}`: a file shipped in the package's conf/, wherever it is installed
if not OmegaConf.has_resolver("arspec_conf"):
    OmegaConf.register_new_resolver("arspec_conf", lambda rel: str(CONF_DIR / rel))


class ConfigError(ValueError):
    """A bad setting or input, reported as one line naming the field and the fix."""


@dataclass
class DataConfig:
    name: str = "shapes"                  # shapes (built-in) | file | imagenet_classes (class ids, c2i models)
    path: Optional[str] = None            # Parquet, CSV, TSV, JSONL or a JSON list of strings (or class ids)
    prompt_column: Optional[str] = None   # auto: prompt, Prompt, caption, text, class_id
    id_column: Optional[str] = None       # absent: ids from content + position
    limit: Optional[int] = None
    builtin_count: int = 96
    classes: Optional[List[int]] = None   # imagenet_classes: the class ids (null = all 1000)
    per_class: int = 1                    # imagenet_classes: images per class


@dataclass
class ClusterConfig:
    address: Optional[str] = None         # attach to a running cluster ("auto", host:port, ray://...); null = a
                                          # private local Ray, even when a head runs on this machine
    num_actors: Optional[int] = None      # null = one per slot the cluster has: per num_gpus_per_actor GPUs, or
                                          # per num_cpus_per_actor CPUs when actors take no GPU
    wait_s: float = 60.0                  # how long to wait for the actors to be placed (an autoscaler may add
                                          # nodes); then run on those placed, or fail in one line if none
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float = 0.0
    batch_size: int = 8                   # rows each actor decodes at once (continuous batching: a row whose
                                          # image is done takes the next prompt)
    part_size: Optional[int] = None       # prompts per part, the unit written, committed, retried and resumed;
                                          # null = batch_size. Larger parts: fewer files
    local_num_cpus: Optional[int] = None  # logical CPUs of the local Ray; null = enough for the actors
    max_actor_restarts: int = 3
    torch_threads: Optional[int] = None   # null = num_cpus_per_actor
    grace_s: float = 20.0                 # on SIGTERM: in-flight parts may finish this long, then exit 143
    lock_timeout_s: float = 60.0          # a lock on out_dir whose owner is silent this long is taken over


@dataclass
class GenerateConfig:
    model: Any = MISSING                  # a model family's config (decoding.registry)
    engine: Any = MISSING                 # an engine's config (decoding.engines)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0
    out_dir: str = "runs/${model.name}/${engine.name}"
    verify: str = "quick"                 # on start, committed parts: quick (sizes, footers, page CRCs) | full (sha256)


def register() -> None:
    from decoding.engines import ENGINES
    from decoding.registry import families
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
    for name, engine in ENGINES.items():
        cs.store(group="schema/engine", name=name, node=engine.Config)
    for name, fam in families().items():
        cs.store(group="schema/model", name=name, node=fam.config)
    from workflows.help import register as register_help
    register_help()      # generate.yaml's hydra/help option


def one_line(e: BaseException) -> str:
    """A Hydra/OmegaConf refusal as one line: the setting, the value, and what is wrong with it."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
    from hydra.errors import MissingConfigException
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    if isinstance(e, MissingConfigException):
        group = str(e).split("Could not find '")[-1].split("'")[0]          # e.g. engine/eagle3
        g, _, choice = group.rpartition("/")
        listing = str(e).split("Available options in")[-1].split("Config search path")[0]
        options = [x.strip() for x in listing.splitlines()[1:] if x.startswith("\t")]
        return f"{g}={choice}: no such {g}; choose one of {', '.join(options) or '(none)'}"
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
        owner = getattr(cause, "object_type", None)
        known = sorted(set(getattr(owner, "__dataclass_fields__", None) or getattr(cause, "parent_node", None) or {}) - {"hydra"})
        key = cause.full_key
        where = owner.__name__ if owner and owner is not dict else (key.rpartition(".")[0] or "the config")
        return f"{key}: {where} has no setting {key.rpartition('.')[2]!r}; its settings are {', '.join(known)}"
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return f"{cause.full_key}={cause.value!r}: {str(cause.msg).splitlines()[0]}"
    return " ".join(str(e).split())


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def one_line_errors(task: Callable) -> Callable:
    """For a Hydra task function: a ConfigError it raises exits 2 with one `error:` line. (SystemExit
    passes through Hydra, which would otherwise add its own "Error executing job" line.)"""
    @functools.wraps(task)
    def wrapper(*args, **kwargs):
        try:
            return task(*args, **kwargs)
        except ConfigError as e:
            fail(str(e))
    return wrapper


def to_object(cfg):
    """The typed config (dataclasses) of a composed Hydra config; a value a dataclass refuses in its
    __post_init__ (e.g. engine.sampling.top_p=2) is a ConfigError."""
    from omegaconf import OmegaConf
    unknown = _unknown_key(cfg)
    if unknown:
        raise ConfigError(unknown)
    try:
        return OmegaConf.to_object(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _unknown_key(node, prefix: str = "") -> str | None:
    """The first key a dataclass-typed node does not declare, as one line (None: none). Hydra refuses
    `engine.chian=4`, but `+engine.chian=4` adds the key to the node, and OmegaConf.to_object would then
    drop it without a word: a typo would run the job on the default instead."""
    import dataclasses
    import difflib
    from omegaconf import DictConfig, OmegaConf
    if not isinstance(node, DictConfig):
        return None
    owner = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else None
    for key, child in node.items_ex(resolve=False):
        full = f"{prefix}{key}"
        if known is not None and key not in known and full != "hydra":
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"its settings are {', '.join(sorted(known))}"
            return f"{full}: {owner.__name__} has no setting {str(key)!r}; {hint}"
        if isinstance(child, DictConfig):
            found = _unknown_key(child, f"{full}.")
            if found:
                return found
    return None


def cli(main: Callable[[], Any]) -> None:
    """Run a @hydra.main entry point; a bad setting exits 2 with one `error:` line (no traceback)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
    try:
        main()
    except (HydraException, OmegaConfBaseException, ConfigError) as e:
        fail(one_line(e))


def exit_now(code: int) -> None:
    """Exit with `code` once stdout, stderr and the logs are flushed, without tearing down native thread
    pools: a pyarrow Parquet thread still joinable at interpreter teardown aborts the process now and
    then (SIGABRT, "terminate called without an active exception") after its work is done, and a CLI's
    exit status is its answer (docs/measurements.md, "The suite on a busy machine")."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
