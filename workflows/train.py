"""Train the built-in models: `python -m workflows.train [stages=[vq,gpt,scorer,drafter]]` (the shapes
models), `stages=[mar_vae,mar,mar_draft]` (the continuous shapes models), or an EAGLE drafter for another
target: `python -m workflows.train stages=[drafter] model=llamagen_c2i ...`.

Each stage reads the outputs of the stages before it from its weights folder and writes one safetensors
file there; a report with every stage's final metrics goes to train_report.json beside them. The folder is
out_dir when given, else the stage's family's packaged weights (decoding/shapes/weights,
decoding/mar/weights), or drafters/<model.name> for another target's drafter.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from decoding.mar.family import WEIGHTS as MAR_WEIGHTS
from decoding.shapes.family import WEIGHTS
from workflows.config import ConfigError, cli, one_line_errors, register, to_object

log = logging.getLogger("arspec.train")
register()


def stage_fns():
    from workflows.training.gpt import train_gpt
    from workflows.training.mar import train_mar, train_vae
    from workflows.training.scorer import train_scorer
    from workflows.training.vq import finetune_decoder, train_vq
    fns = {"vq": train_vq, "vq_decoder": finetune_decoder, "gpt": train_gpt, "scorer": train_scorer,
           "mar_vae": train_vae, "mar": train_mar, "mar_draft": lambda c, d: train_mar(c, d, "mar_draft")}
    try:
        from workflows.training.drafter import train_drafter
        fns["drafter"] = train_drafter
    except ImportError:
        pass
    return fns


HOMES = {"mar_vae": MAR_WEIGHTS, "mar": MAR_WEIGHTS, "mar_draft": MAR_WEIGHTS}   # the rest: WEIGHTS
TITLES = {MAR_WEIGHTS: "Continuous shapes weights (KL VAE, MAR target and draft)"}


def training_card(report: dict, out_dir: Path, title: str = "Shapes weights") -> str:
    """TRAINING.md beside the weights: how each file was made and what it reached."""
    lines = [f"# {title}", "", "Trained on CPU by `python -m workflows.train` (conf/train.yaml); "
             "this file is rewritten by every training run from train_report.json.", "",
             "| file | bytes |", "|---|---|"]
    files = sorted(out_dir.glob("*.safetensors"))
    lines += [f"| {f.name} | {f.stat().st_size:,} |" for f in files]
    lines += [f"| total | {sum(f.stat().st_size for f in files):,} |", ""]
    for name, r in report.items():
        lines += [f"## {name}", ""]
        chain = r.get("resumed_from", [])  # a stage continued from its own earlier weights
        for i, earlier in enumerate(chain):
            lines += [f"- {'first' if i == 0 else 'then'}: `{earlier['command']}` ({earlier['minutes']} min, "
                      f"reached `{json.dumps(earlier['metrics'])}`)"]
        lines += [f"- {'then, these weights' if chain else 'command'}: `{r['command']}`", f"- minutes: {r['minutes']} "
                  f"(torch {r['torch']}, {r['threads']} threads)", f"- final metrics: `{json.dumps(r['metrics'])}`", ""]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
@one_line_errors
def main(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = to_object(cfg.model)
    shapes = model.name == "shapes"
    fns = stage_fns()
    unknown = [s for s in cfg.stages if s not in fns]
    if unknown:
        raise ConfigError(f"stages={list(cfg.stages)}: unknown {unknown}; choose from {list(fns)}")
    if not shapes and list(cfg.stages) != ["drafter"]:
        raise ConfigError(f"stages={list(cfg.stages)}: model={model.name} trains only a drafter for its target "
                          f"(stages=[drafter]); the other stages build the built-in models")
    for name in cfg.stages:
        home = HOMES.get(name, WEIGHTS) if shapes else Path("drafters") / model.name
        out_dir = Path(cfg.out_dir) if cfg.out_dir else home
        out_dir.mkdir(parents=True, exist_ok=True)
        report_path = out_dir / "train_report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        previous = dict(report)
        t0 = time.time()
        log.info(f"stage {name}: starting")
        metrics = fns[name](cfg[name], out_dir, model=model) if name == "drafter" else fns[name](cfg[name], out_dir)
        report[name] = {"metrics": metrics, "config": OmegaConf.to_container(cfg[name], resolve=True),
                        "command": "python -m workflows.train " + " ".join(sys.argv[1:]),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "minutes": round((time.time() - t0) / 60, 1)}
        if not shapes:
            report[name]["model"] = OmegaConf.to_container(cfg.model, resolve=True)
        if cfg[name].get("resume") and name in previous:  # keep the history of the weights it continued
            old = dict(previous[name])
            report[name]["resumed_from"] = [*old.pop("resumed_from", []), old]
        report_path.write_text(json.dumps(report, indent=2))
        title = TITLES.get(home, "Shapes weights") if shapes else f"Drafter for {model.name}"
        (out_dir / "TRAINING.md").write_text(training_card(report, out_dir, title))
        log.info(f"stage {name}: done in {(time.time() - t0) / 60:.1f} min -> {out_dir}")


if __name__ == "__main__":
    cli(main)
