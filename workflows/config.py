"""Structured config of the generate job (Hydra): dataclass schemas, YAML groups in conf/.

conf/generate.yaml composes model/, engine/, data/ and cluster/ on top of `GenerateConfig`, so a
misspelt key or a wrong type is refused by Hydra before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


class ConfigError(ValueError):
    """A bad setting or input, reported as one line naming the field and the fix."""


@dataclass
class ModelConfig:
    name: str = "shapes"
    weights_dir: Optional[str] = None     # null = the shapes weights shipped in the package
    device: str = "auto"                  # auto = cuda when the actor has a GPU, else cpu
    dtype: str = "auto"                   # auto = bf16 on CUDA or on CPUs with AMX / AVX512-BF16, else fp32


@dataclass
class EngineConfig:
    name: str = "vanilla"                 # vanilla | eagle2 | adt_tree
    cfg_scale: float = 1.5
    temperature: float = 1.0
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0
    # draft trees (eagle2, adt_tree)
    total_tokens: int = 60                # node budget per tree
    depth: int = 6                        # eagle2 depth; adt_tree initial depth
    width: int = 10                       # per-level top-k; adt_tree initial width
    acceptance: str = "exact"             # exact (lossless) | lantern (relaxed, TVD <= lantern_delta)
    lantern_k: int = 100
    lantern_delta: float = 0.1
    # adt_tree
    d_min: int = 2
    d_max: int = 10
    w_min: int = 1
    w_max: int = 10
    beta: float = 0.5
    adjacency: str = "horizontal"         # horizontal | 2d


@dataclass
class DataConfig:
    name: str = "shapes"                  # shapes (built-in) | file
    path: Optional[str] = None            # Parquet, CSV, TSV, JSONL or a JSON list of strings
    prompt_column: Optional[str] = None   # auto: prompt, Prompt, caption, text
    id_column: Optional[str] = None       # absent: ids from content + position
    limit: Optional[int] = None
    builtin_count: int = 96


@dataclass
class ClusterConfig:
    address: Optional[str] = None         # attach to a running cluster ("auto" or ray://...); null = local Ray
    num_actors: Optional[int] = None      # null = one per slot: per GPU, or per num_cpus_per_actor CPUs
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float = 0.0
    batch_size: int = 8
    local_num_cpus: Optional[int] = None  # logical CPUs of the local Ray; null = enough for the actors
    max_actor_restarts: int = 3
    torch_threads: Optional[int] = None   # null = num_cpus_per_actor


@dataclass
class GenerateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0
    out_dir: str = "runs/${model.name}/${engine.name}"


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
