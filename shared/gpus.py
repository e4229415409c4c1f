"""GPU groups: which GPUs each engine (and its generator) owns, and which GPUs training gets.

A layout is a list of groups of equal size; a group of N GPUs is one engine with tensor parallelism N
(`--tp-size N`, `CUDA_VISIBLE_DEVICES` set to the group). Two spellings, both accepted, meaning the same:

- `--gpus 0,1,2,3 --tp 2`: the GPUs, cut in order into groups of `tp` (the usual case: one number to vary
  while calibrating TP=1 ×4 against TP=2 ×2, and the list stays the node's GPUs);
- `--gpus 0-1,2-3`: each group written out (`a-b` is GPUs a to b inclusive), for an order the first
  spelling cannot say (GPUs paired by NVLink, say `0-1,4-5`).

Groups must be of one size (one engine shape per run: calibration and the planner count engines of one
throughput) and no GPU may appear twice.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A GPU layout that cannot be run, with what is wrong in it."""


@dataclass(frozen=True)
class GpuGroup:
    gpus: tuple[int, ...]

    @property
    def tp(self) -> int:
        """The tensor-parallel size of the group's engine."""
        return len(self.gpus)

    @property
    def visible_devices(self) -> str:
        """`CUDA_VISIBLE_DEVICES` for the group's engine."""
        return ",".join(str(g) for g in self.gpus)

    @property
    def label(self) -> str:
        """A name part unique per group on a host (worker names): `3`, or `2-3` for a group."""
        return "-".join(str(g) for g in self.gpus)

    @property
    def arg(self) -> str:
        """The group as `dfpipe generate --gpus` takes it."""
        return self.visible_devices


def _gpu(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LayoutError(f"--gpus {spec!r}: {text.strip()!r} is not a GPU index") from None
    if value < 0:
        raise LayoutError(f"--gpus {spec!r}: GPU index {value} is negative")
    return value


def parse_layout(spec: str, tp: int = 1) -> list[GpuGroup]:
    """`0,1,2,3` with tp 2, or `0-1,2-3` (tp 1 or the groups' size) → the groups, checked."""
    if tp < 1:
        raise LayoutError(f"--tp {tp}: the tensor-parallel size is at least 1")
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise LayoutError(f"--gpus {spec!r}: no GPU named")
    written: list[tuple[int, ...]] = []
    for item in items:
        if "-" in item:
            lo, _, hi = item.partition("-")
            a, b = _gpu(lo, spec), _gpu(hi, spec)
            if b < a:
                raise LayoutError(f"--gpus {spec!r}: range {item!r} runs backwards")
            written.append(tuple(range(a, b + 1)))
        else:
            written.append((_gpu(item, spec),))
    flat = [g for group in written for g in group]
    if dupes := sorted({g for g in flat if flat.count(g) > 1}):
        raise LayoutError(f"--gpus {spec!r}: GPU {', '.join(map(str, dupes))} named twice")
    if any(len(g) > 1 for g in written):  # groups written out
        sizes = {len(g) for g in written}
        if len(sizes) > 1:
            raise LayoutError(f"--gpus {spec!r}: groups of different sizes ({sorted(sizes)}); one engine shape per run")
        if tp not in (1, len(written[0])):
            raise LayoutError(f"--gpus {spec!r} are groups of {len(written[0])}, but --tp {tp} was given")
        return [GpuGroup(g) for g in written]
    if len(flat) % tp:
        raise LayoutError(f"--gpus {spec!r}: {len(flat)} GPUs do not split into groups of --tp {tp}")
    return [GpuGroup(tuple(flat[i:i + tp])) for i in range(0, len(flat), tp)]


def all_gpus(groups: list[GpuGroup]) -> list[int]:
    """Every GPU of a layout, in order (what training gets once the engines are stopped)."""
    return [g for group in groups for g in group.gpus]
