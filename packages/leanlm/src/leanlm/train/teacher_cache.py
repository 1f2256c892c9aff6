"""The `distill` stage's offline teacher (`teacher = "cached"`): top-k logits written once.

Before training, the main process runs the teacher over every micro-batch the stage will train
on and writes its top-`top_k` logits (`prune_distill.cache_teacher_topk`) into
`<stage>/teacher-cache`; then every process trains the student from the files with no teacher in
memory. The folder is written atomically with a manifest of the settings and file sizes, so a
resume reuses a complete cache and rewrites a stale or damaged one. A micro-batch finds its
logits by a hash of its sequences' token ids, so lookups do not depend on the trainer's position.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leanlm.data import global_batch_indices
from leanlm.stages.base import StageContext
from leanlm.train.checkpoint import save_atomically

if TYPE_CHECKING:
    from leanlm.config import DistillConfig

CACHE_DIR = "teacher-cache"
"""The cache's folder in the stage's directory."""
MANIFEST = "cache.json"
"""What the cache was made for, its files with their sizes, and each file's row keys."""


def stage_micro_batches(
    ctx: StageContext, cfg: DistillConfig, *, steps: int
) -> Iterator[torch.Tensor]:
    """The first `steps` global batches of the stage, in micro-batches `(B, T)`.

    In the trainer's order (`leanlm.train.trainer`: process r's micro-batches are the r-th slice).
    Every process walks the whole global batch, so all of them see the same sequences without
    communicating.
    """
    blocks = ctx.resources.train_blocks
    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * ctx.accelerator.num_processes
    for step in range(steps):
        indices = global_batch_indices(
            step, global_batch=global_batch, num_blocks=blocks.shape[0], seed=ctx.config.seed
        )
        chunk = blocks[indices]
        for start in range(0, global_batch, cfg.micro_batch_size):
            yield chunk[start : start + cfg.micro_batch_size]


def row_key(row: torch.Tensor) -> str:
    """The lookup key of one sequence `(T,)` of token ids (a hash of its int64 bytes)."""
    data = row.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def teacher_identity(teacher_dir: Path) -> str:
    """What identifies the teacher's weights, not just its folder.

    A stage of a run (a folder next to the stage's `result.json`): `stage:<its config hash>`,
    which changes whenever the stage is rerun on other inputs. Else (`init_model`) the SHA-256
    of its weight files (`*.safetensors`, `*.bin`); a hub id that is not a local folder: the id.
    """
    teacher_dir = Path(teacher_dir)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        stored = json.loads((teacher_dir.parent / "result.json").read_text()).get("config_hash")
        if isinstance(stored, str) and (teacher_dir.parent / "model") == teacher_dir:
            return f"stage:{stored}"
    if not teacher_dir.is_dir():
        return f"name:{teacher_dir}"
    digest = hashlib.sha256()
    weights = [*teacher_dir.glob("*.safetensors"), *teacher_dir.glob("*.bin")]
    for path in sorted(weights):
        with open(path, "rb") as f:
            digest.update(f"{path.name}:{hashlib.file_digest(f, 'sha256').hexdigest()};".encode())
    return f"weights:{digest.hexdigest()[:16]}"


def _fingerprint(ctx: StageContext, cfg: DistillConfig, teacher: str, top_k: int) -> str:
    """The settings the cached logits depend on (teacher, data, batches, order, k)."""
    settings = {
        "run": ctx.config.fingerprint("seed", "data", "tokenizer", "init_model"),
        "teacher": teacher,
        "steps": cfg.steps,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
        "processes": ctx.accelerator.num_processes,
        "top_k": top_k,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _check(folder: Path, fingerprint: str, teacher: str) -> str | None:
    """Why the cache in `folder` cannot be used (None: it can)."""
    if not folder.is_dir():
        return "absent"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    if manifest.get("fingerprint") != fingerprint:
        if manifest.get("teacher") != teacher:
            return "made with another teacher (its stage was rerun, or its weights changed)"
        return "made for other settings"
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or not {size} bytes"
    return None


def ensure_cache(
    ctx: StageContext, cfg: DistillConfig, teacher_dir: Path, *, vocab_size: int
) -> CachedTeacher:
    """The stage's teacher cache: reused when complete for these settings, else written.

    The main process writes it (loading the teacher, frozen, in its checkpoint dtype, and
    freeing it afterwards); the others wait for it.
    """
    from leanlm.train.model import load_teacher
    from prune_distill import cache_teacher_topk

    acc = ctx.accelerator
    folder = ctx.stage_dir / CACHE_DIR
    top_k = min(cfg.top_k or vocab_size, vocab_size)
    teacher_id = teacher_identity(teacher_dir) if acc.is_main_process else ""
    fingerprint = _fingerprint(ctx, cfg, teacher_id, top_k)
    reason = _check(folder, fingerprint, teacher_id) if acc.is_main_process else None
    if acc.is_main_process and reason is not None:
        if reason != "absent":
            acc.print(f"[distill] teacher cache {folder}: {reason}; writing it again")
        teacher = load_teacher(teacher_dir).to(acc.device)
        keys: list[list[str]] = []

        def batches() -> Iterator[dict[str, torch.Tensor]]:
            for micro in stage_micro_batches(ctx, cfg, steps=cfg.steps):
                keys.append([row_key(row) for row in micro])
                yield {"input_ids": micro.to(acc.device)}

        def write(tmp: Path) -> None:
            cache = cache_teacher_topk(teacher, batches(), tmp, top_k=top_k)
            for file in cache.files:  # on disk before the folder is renamed into place
                with open(file, "rb+") as f:
                    os.fsync(f.fileno())
            files = {file.name: file.stat().st_size for file in cache.files}
            manifest = {
                "fingerprint": fingerprint,
                "teacher": teacher_id,
                "top_k": top_k,
                "files": files,
                "keys": keys,
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())

        save_atomically(folder, write)
        del teacher
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    acc.wait_for_everyone()
    cached = CachedTeacher(folder)
    what = "reused" if reason is None else "written"
    acc.print(
        f"[distill] teacher cache {folder} ({what}): top-{top_k} logits of "
        f"{len(cached.files)} micro-batches, {cached.disk_bytes / 2**20:.1f} MiB on disk"
    )
    return cached


class CachedTeacher:
    """Looks up the cached top-k logits of a micro-batch's sequences (one file held at a time)."""

    def __init__(self, folder: Path) -> None:
        manifest = json.loads((folder / MANIFEST).read_text())
        self.folder = folder
        self.top_k: int = manifest["top_k"]
        self.files = [folder / name for name in manifest["files"]]
        self.disk_bytes = sum(manifest["files"].values()) + (folder / MANIFEST).stat().st_size
        self._where = {
            key: (i, row) for i, rows in enumerate(manifest["keys"]) for row, key in enumerate(rows)
        }
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None

    def _record(self, i: int) -> dict[str, torch.Tensor]:
        if self._loaded is None or self._loaded[0] != i:
            self._loaded = (i, torch.load(self.files[i], weights_only=True))
        return self._loaded[1]

    def lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k `(values, indices)`, each `(B, T, k)` on `input_ids`' device, for `(B, T)` ids.

        Raises:
            ValueError: a sequence is not in the cache (it was made for other batches).
        """
        from prune_distill.cache import TOPK_INDICES, TOPK_VALUES

        values, indices = [], []
        for row in input_ids:
            found: Any = self._where.get(row_key(row))
            record = self._record(found[0]) if found is not None else None
            if record is None or not torch.equal(record["input_ids"][found[1]], row.cpu()):
                raise ValueError(
                    f"a training sequence is not in the teacher cache {self.folder}; delete the "
                    "folder to have it written again for this run's batches"
                )
            values.append(record[TOPK_VALUES][found[1]])
            indices.append(record[TOPK_INDICES][found[1]])
        device = input_ids.device
        return torch.stack(values).to(device), torch.stack(indices).to(device, torch.int64)
