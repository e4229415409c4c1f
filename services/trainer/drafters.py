"""The drafter architectures this project trains, by their `config.json` name, and the one way to open a
saved drafter: a checkpoint of an architecture we do not know, or whose config lacks a key its
architecture needs, is refused by name before any tensor is read (never a shape error deep in
`load_state_dict`). Training's resume and `dfpipe eval` open checkpoints through `load_drafter`."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from .model import DFlashDrafter
from .model_dflash2 import DFlash2Drafter

# trainer.arch → drafter class; each class's config names its `architectures` entry
ARCHS: dict[str, type[DFlashDrafter]] = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter}
BY_ARCHITECTURE = {cls.config_class.ARCHITECTURE: cls for cls in ARCHS.values()}


def arch_name(drafter: DFlashDrafter) -> str:
    """The config.json architecture of a drafter ("DFlashDraftModel", "DFlash2DraftModel")."""
    return drafter.config_class.ARCHITECTURE


def drafter_class(hf: dict[str, Any], where: str) -> type[DFlashDrafter]:
    """The class for a config.json, or a ValueError that names what is unknown or missing."""
    names = hf.get("architectures") or []
    known = [BY_ARCHITECTURE[n] for n in names if n in BY_ARCHITECTURE]
    if len(names) != 1 or not known:
        raise ValueError(f"{where}: architectures {names} is not one this trainer knows "
                         f"({', '.join(BY_ARCHITECTURE)})")
    cls = known[0]
    dflash = hf.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: {names[0]} without a dflash_config")
    missing = [f"dflash_config.{k}" for k in cls.config_class.DFLASH_KEYS if k not in dflash]
    top = [f.name for f in fields(cls.config_class) if f.default is MISSING and f.default_factory is MISSING
           and f.name not in cls.config_class.DFLASH_KEYS]
    missing += [k for k in top if k not in hf]
    if missing:
        raise ValueError(f"{where}: the {names[0]} config lacks {', '.join(missing)}")
    return cls


def load_drafter(directory: Path, where: str | None = None) -> DFlashDrafter:
    """A saved drafter (config.json + model.safetensors), of whichever known architecture it is."""
    hf = json.loads((directory / "config.json").read_text())
    return drafter_class(hf, where or str(directory)).load(directory)


def new_drafter(t: Any, target_config: Any, **kw: Any) -> DFlashDrafter:
    """A fresh drafter of `trainer.arch` for this target (`t` the trainer config; `kw` DFlashConfig.for_target's)."""
    if t.arch == "dflash":
        return DFlashDrafter.for_target(target_config, **kw)
    if t.draft_vocab:
        raise ValueError("trainer.draft_vocab is for trainer.arch = dflash only: DFlash 2's selector codebooks "
                         "span the target's whole vocabulary, as the reference's and the engines' do")
    try:
        return DFlash2Drafter.for_target(target_config, conv_kernel_size=t.conv_kernel_size,
                                         conv_group_size=t.conv_group_size, selector_rank=t.selector_rank,
                                         selector_top_k=t.selector_top_k, **kw)
    except ValueError as e:
        raise ValueError(f"trainer.{e}") from None
