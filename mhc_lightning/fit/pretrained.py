"""Trained weights for use outside the platform: `mhc export CKPT OUT_DIR` writes `model.safetensors` (the GPT's
weights) and `config.json` (its resolved architecture and where it came from); `load_pretrained(OUT_DIR)` builds the
GPT again from those two files alone, with torch and safetensors (no Lightning, no MLflow, no checkpoint).

    from mhc_lightning import load_pretrained
    model = load_pretrained("exported/")          # a plain nn.Module (model/gpt.py), in eval mode
    print(model.generate("ROMEO:", 100, temperature=0.8, top_k=40).decode(errors="replace"))
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import UserError

WEIGHTS, CONFIG = "model.safetensors", "config.json"
FORMAT = "mhc_lightning.GPT/1"  # config.json's "format": what wrote the folder, and the version of its layout


def save_pretrained(model, out_dir: Union[str, Path], **source: Any) -> Path:
    """Write `model` (a GPT) as OUT_DIR/model.safetensors and OUT_DIR/config.json; `source` (checkpoint, step, run)
    is recorded in config.json. The tied embedding / head weight is stored once (safetensors' save_model)."""
    from safetensors.torch import save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / WEIGHTS), metadata={"format": FORMAT})
    config = {"format": FORMAT, "arch": asdict(model.cfg), "source": source}
    (out / CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return out


def load_pretrained(path: Union[str, Path], device: str = "cpu"):
    """The GPT of an exported folder (`mhc export`), on `device`, in eval mode."""
    from safetensors.torch import load_model

    from ..model import GPT, GPTConfig

    folder = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise UserError(f"{folder} holds no {name}; pass a folder written by `mhc export CKPT OUT_DIR`.")
    config = json.loads((folder / CONFIG).read_text())
    if config.get("format") != FORMAT:
        raise UserError(f"{folder / CONFIG} has format {config.get('format')!r}, not {FORMAT!r}.")
    model = GPT(GPTConfig(**config["arch"]))
    load_model(model, str(folder / WEIGHTS), device=device)
    return model.to(device).eval()


def export_checkpoint(ckpt: Union[str, Path], out_dir: Union[str, Path], force: bool = False) -> Path:
    """`mhc export`: the GPT of a `mhc fit` checkpoint (verified against the digest written with it) as
    save_pretrained writes it. Refuses, before writing anything, a missing or corrupted checkpoint, one that `mhc fit`
    did not write, and files already in OUT_DIR unless `force`."""
    from ..loggers.tags import CHECKPOINT_RUN_KEY
    from ..training.checkpoint_io import verify
    from ..training.module import LitLM

    ckpt, out = Path(ckpt), Path(out_dir)
    if not ckpt.is_file():
        what = "is a folder (a sharded checkpoint)" if ckpt.is_dir() else "does not exist"
        raise UserError(f"checkpoint {ckpt} {what}; pass a .ckpt file written by mhc fit.")
    there = [name for name in (WEIGHTS, CONFIG) if (out / name).exists()]
    if there and not force:
        raise UserError(f"{out} already holds {', '.join(there)}; pass another OUT_DIR, or --force to replace them.")
    if not zipfile.is_zipfile(ckpt):  # torch.save writes zip archives; anything else is no checkpoint at all
        raise UserError(f"{ckpt} is not a checkpoint (not a torch.save archive); pass a .ckpt file written by mhc fit.")
    verify(ckpt)
    try:
        lit = LitLM.load_from_checkpoint(ckpt, map_location="cpu")
        meta = _checkpoint_meta(ckpt, CHECKPOINT_RUN_KEY)
    except Exception as err:  # torch and Lightning raise many types for a file that is not an mhc checkpoint
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"checkpoint {ckpt} cannot be loaded ({first}); pass a .ckpt file written by mhc fit."
        ) from None
    return save_pretrained(lit.model, out, checkpoint=str(ckpt.resolve()), **meta)


def _checkpoint_meta(ckpt: Path, run_key: str) -> dict[str, Optional[str]]:
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    run = state.get(run_key) or {}
    return {"global_step": state.get("global_step"), "mlflow_run_id": run.get("run_id")}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mhc export",
        description="Write a checkpoint's model as OUT_DIR/model.safetensors and OUT_DIR/config.json, loadable with "
        "mhc_lightning.load_pretrained(OUT_DIR) (docs/api.md).",
    )
    parser.add_argument("ckpt", help="a .ckpt file written by mhc fit (e.g. runs/<exp>/<run>/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the folder to write (created if needed)")
    parser.add_argument("--force", action="store_true", help="replace model.safetensors / config.json already there")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.ckpt, args.out_dir, args.force)
    print(f"exported {args.ckpt} -> {out / WEIGHTS}, {out / CONFIG}", file=sys.stdout)
    return 0
