"""`python -m workflows.generate --help`: the job, its engines and model families, which to pick.

One line per group option, taken from the first sentence of the comment atop its conf/<group>/<name>.yaml
(the one place that describes it); what an engine needs (a drafter, continuous tokens) comes from the
engine classes. Registered as Hydra's `hydra/help` option `generate`, so Hydra prints it, and the
internal `schema/*` groups stay out of it.
"""
from __future__ import annotations

import re
from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "conf"

PICK = """\
Which engine:
  the default               engine=auto: adt_tree with chains where the model has a drafter, chains of the
                            target's own draws where it has none, mar for continuous tokens; vanilla's tokens
  exact and simplest        engine=vanilla (the baseline every other engine is checked against)
  no drafter for the model  engine=auto, or engine=sjd or engine=mc_sjd (drafter-free Jacobi windows, exact)
  a drafter for the model   engine=eagle2 or engine=adt_tree (model=shapes ships one; LlamaGen: model.drafter_ckpt)
  continuous tokens         engine=mar (baseline) or engine=cspd (speculative), with model=mar
  CPU or GPU                the same engines; the device is model.device (auto: cuda when visible);
                            a Ray cluster with one actor per GPU is cluster=gpu"""


def first_sentence(yaml_path: Path) -> str:
    """The first sentence of the comment block at the top of a YAML file ('' when it has none)."""
    lines = []
    for line in yaml_path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
        if line.endswith(":"):     # an example command follows
            break
    text = " ".join(lines)
    end = re.search(r"(?<!e\.g)\.(\s|$)", text)
    return (text if end is None else text[:end.start() + 1]).rstrip(":")


def _needs(name: str) -> str:
    from decoding.engines import ENGINES
    from decoding.engines.mar import ContinuousEngine
    e = ENGINES.get(name)
    if e is None:
        return ""
    if name == "auto":
        return "[any model] "
    if issubclass(e, ContinuousEngine):
        return "[continuous] "
    return "[drafter] " if e.uses_drafter else "[no drafter] "


def group_lines(group: str, tag=lambda name: "") -> str:
    rows = [(p.stem, tag(p.stem) + first_sentence(p)) for p in sorted((CONF / group).glob("*.yaml"))]
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"  {group}={n:<{width}}  {text}" for n, text in rows)


def generate_help() -> str:
    """The help page's text."""
    text = f"""\
arspec generate: a batch of images from a prompt set, decoded by a visual autoregressive model on Ray
actors, written to out_dir as PNGs plus Parquet tables (images, per-token acceptance) and summary.json.
A rerun with the same settings completes an interrupted job; a changed setting needs a new out_dir.

Usage: python -m workflows.generate [GROUP=OPTION ...] [key=value ...]
  e.g. python -m workflows.generate engine=sjd data=parti data.limit=16 out_dir=runs/try

Engines (engine=...):
{group_lines("engine", _needs)}

{PICK}

Model families (model=...):
{group_lines("model")}

Prompt sets (data=...):
{group_lines("data")}

Clusters (cluster=...):
{group_lines("cluster")}

Settings: seed, out_dir, verify, and engine.*, model.*, data.*, cluster.* of the chosen options
(an unknown key is refused with the list of known ones). Print the composed settings with --cfg job.
Hydra's own flags: --cfg, --info, --hydra-help, -m (multirun)."""
    return text.replace("$", "$$")   # the template is read by string.Template


def register() -> None:
    from hydra.conf import HelpConf
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(group="hydra/help", name="generate", node=HelpConf(
        app_name="generate", header="", footer="", template=generate_help()))
