"""Where a model folder came from: the record a structural change leaves for later stages.

A stage that cuts a model (`prune`) writes `pruned_from.json` (`PRUNED_FROM`) next to the model:
the source model folder and, for each kept layer, the source layer it was cut from. A later stage
(`distill`'s hidden-state loss) reads it to match layers. Neither stage imports the other; both
use this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PRUNED_FROM = "pruned_from.json"
"""File in a pruned model's folder: `{"source": ..., "layer_map": {student: source}}`."""


def path_from(run_dir: Path, path: Path) -> str:
    """`path` relative to the run folder (so a moved run still matches), else absolute."""
    return os.path.relpath(path.resolve(), run_dir.resolve())


def write_lineage(folder: Path, run_dir: Path, source: Path, layer_map: dict[int, int]) -> None:
    """Record in `folder` that its model was cut from `source`, layer by layer."""
    record = {"source": path_from(run_dir, source), "layer_map": layer_map}
    (folder / PRUNED_FROM).write_text(json.dumps(record), encoding="utf-8")


def pruned_layer_map_for(run_dir: Path, student_dir: Path, teacher_dir: Path) -> dict[int, int]:
    """The student layer -> teacher layer map recorded in `student_dir`, if cut from `teacher_dir`.

    Empty when `student_dir` holds no record or was cut from another model.
    """
    record = student_dir / PRUNED_FROM
    if not record.is_file():
        return {}
    data = json.loads(record.read_text(encoding="utf-8"))
    if data.get("source") != path_from(run_dir, teacher_dir):
        return {}
    return {int(s): int(t) for s, t in data["layer_map"].items()}
