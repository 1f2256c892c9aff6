"""Stage `sparsify`: one-shot pruning (sparse-kernels), then a short sparse fine-tune.

`sparse_kernels.sparsify_` prunes every decoder Linear of the previous stage's model in place
(default: 2:4 with Wanda scores from calibration sequences); the masks are parametrizations, so
they hold through the optimizer's steps and checkpoints. The one-shot perplexity is measured
before the fine-tune. The folder is `save_pretrained_sparse`'s (zeros baked in, plain
`from_pretrained` works, plus bit-packed masks), with the compact `save_compressed` format next
to it and its size reported.

With `pattern = "block"` and `block_sparse_layers` on (`SparsifyConfig.block_sparse_on`), the
fine-tune trains sparse-kernels' `BlockSparseLinear` layers: `to_block_sparse_` converts the
masked Linears after the one-shot evaluation (a resumed run does the same before its checkpoint
loads, so the parameter names match), and `to_masked_linear_` converts them back before the
save, so the folder is exactly the masked fine-tune's format. The choice is recorded in the
stage folder (`CHOICE_FILE`) before the fine-tune, and a resumed run keeps it whatever its
device (`block_sparse_choice`). Every engine takes them: a sharded run (ZeRO, FSDP2) loads its
gathered state dict into a CPU copy built with the same block-sparse layers, which is converted
back the same way. With CAME / Adafactor the factored statistics of those layers are per b x b
tile (their parameter is (tiles, b, b)); AdamW's updates are the masked fine-tune's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from leanlm.config import ConfigError, SparsifyConfig
from leanlm.stages.base import Stage, StageContext, StageResult

if TYPE_CHECKING:
    import torch

COMPRESSED_FILE = "compressed.safetensors"
CHOICE_FILE = "block_sparse_layers.json"
"""In the stage folder: whether the fine-tune runs block-sparse layers, and the stage's config
hash it was chosen under (`block_sparse_choice`)."""


def _save_sparse(
    model: torch.nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None
) -> None:
    """`save_pretrained_sparse` of the trained model (of a gathered copy when it is sharded).

    Block-sparse layers (`block_sparse_layers`) become masked Linears first, in the model or
    in its gathered copy.
    """
    from sparse_kernels import save_pretrained_sparse, to_masked_linear_

    if state_dict is not None:  # ZeRO, FSDP2: `model` holds this process's shards only
        model = _unsharded_copy(model, state_dict)
    to_masked_linear_(model)
    save_pretrained_sparse(model, folder)


def _unsharded_copy(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> Any:
    """A plain CPU model of `model`'s architecture and masks holding the gathered `state_dict`.

    The masks (buffers, which the engines leave whole on every process) are attached first so
    that the copy has the same parametrized keys (`...parametrizations.weight.original`), and
    each `BlockSparseLinear` of `model` is one in the copy too, with the same tiles (its
    `values` (tiles, b, b) and index buffers are keys of `state_dict`); a tied weight comes once
    in `state_dict` and reaches its other name through the tie.

    Raises:
        RuntimeError: `state_dict` does not cover the copy (a key missing that no tie explains,
            or one the copy does not have).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from sparse_kernels import BlockSparseLinear, apply_mask_, masks

    config: Any = model.config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.generation_config = model.generation_config
    for name, mask in masks(model).items():
        apply_mask_(plain.get_submodule(name), mask.cpu())
    for name, layer in model.named_modules():
        if isinstance(layer, BlockSparseLinear):
            tiles = layer.layout.block_mask().cpu()
            copy = BlockSparseLinear(
                layer.in_features,
                layer.out_features,
                block_mask=tiles,
                block_size=layer.block_size,
                bias=layer.bias is not None,
                backend="torch",
            )
            plain.set_submodule(name, copy)
    missing, unexpected = plain.load_state_dict(state_dict, strict=False)
    params = dict(plain.named_parameters(remove_duplicate=False))
    loaded = {id(p) for name, p in params.items() if name in state_dict}
    untied = [name for name in missing if name not in params or id(params[name]) not in loaded]
    if untied or unexpected:
        raise RuntimeError(
            f"the gathered state does not match the model: missing {untied}, unexpected "
            f"{unexpected}"
        )
    return plain


class Sparsify(Stage):
    """Prune the previous stage's model one-shot, fine-tune it sparse, save it."""

    name: ClassVar[str] = "sparsify"
    config: ClassVar[type] = SparsifyConfig
    summary: ClassVar[str] = "2:4 / unstructured sparsity"

    def run(self, ctx: StageContext) -> StageResult:
        """Mask, score the one-shot model, fine-tune with masks held, save both formats."""
        from leanlm.stages.calibration import load_input_with_calibration
        from leanlm.train.evaluate import causal_lm_loss, evaluate_validation
        from leanlm.train.model import TRAIN_DTYPE, load_model
        from leanlm.train.trainer import train
        from sparse_kernels import load_masks_, save_compressed, sparsify_, sparsity_report

        cfg: SparsifyConfig = ctx.section
        acc = ctx.accelerator
        start = time.perf_counter()
        block_sparse = block_sparse_choice(ctx, cfg)  # before any work: it may be a ConfigError
        # the checkpoint's dtype (bf16 stays bf16); sparse-kernels computes the statistics and
        # SparseGPT's solve in fp32 whatever the weights' dtype
        model, batches = load_input_with_calibration(ctx)
        # Deterministic given the calibration batches: a resumed run rebuilds the same masks
        # before its checkpoint restores the fine-tuned weights.
        sequential = cfg.sequential and cfg.method != "magnitude"  # magnitude has no statistics
        try:
            sparsify_(model, cfg.sparsity_config, calibration=batches, sequential=sequential)
        except ValueError as err:
            if not sequential or "sequential" not in str(err):
                raise
            raise ConfigError("sparsify.sequential", f"{err} (here: `sequential = false`)") from err
        # masked Linears by module name; matrix weights no mask covers (3-D MoE experts) by name
        report = sparsity_report(model)
        params = dict(model.named_parameters())
        sizes = {
            n: params[n].numel() if n in params else model.get_submodule(n).weight.numel()
            for n in report
        }
        target = sum(sizes.values())
        zeros = sum(frac * sizes[n] for n, frac in report.items())
        dense = sum(n in params for n in report)
        one_shot = evaluate_validation(ctx, model, batch_size=cfg.eval_batch_size)
        acc.print(
            f"[sparsify] {cfg.pattern} {cfg.method}: {len(report) - dense} Linears"
            + (f" and {dense} weights left dense" if dense else "")
            + f", {zeros / target:.1%} of their weights zero; one-shot validation perplexity "
            f"{one_shot.perplexity:.2f}"
        )
        metrics: dict[str, Any]
        if cfg.steps:  # the fine-tune keeps fp32 weights (the engines' masters), masks kept
            model = model.to(TRAIN_DTYPE)
            converted = _to_block_sparse(ctx, model, cfg) if block_sparse else 0
            metrics = train(ctx, model, cfg, causal_lm_loss, save=_save_sparse)
            metrics["block_sparse_layers"] = converted
        else:
            metrics = _save_one_shot(ctx, model, one_shot)
        final = load_model(ctx.model_dir)
        if acc.is_main_process:
            load_masks_(final, ctx.model_dir)  # the compact format needs the masks attached
            tmp = ctx.stage_dir / f".tmp-{COMPRESSED_FILE}"
            save_compressed(final, tmp)
            tmp.replace(ctx.stage_dir / COMPRESSED_FILE)
        acc.wait_for_everyone()
        metrics.update(
            {
                "wall_time_s": time.perf_counter() - start,
                "one_shot_val_perplexity": one_shot.perplexity,
                "masked_sparsity": zeros / target,
                "compressed_bytes": (ctx.stage_dir / COMPRESSED_FILE).stat().st_size,
                "disk_bytes": (ctx.stage_dir / COMPRESSED_FILE).stat().st_size,
                "calibration_tokens": sum(b["input_ids"].numel() for b in batches),
            }
        )
        after = (
            f"{metrics['val_perplexity']:.2f} after the sparse fine-tune ({cfg.steps} steps)"
            if cfg.steps
            else "no sparse fine-tune (`sparsify.steps` = 0)"
        )
        note = (
            f"{zeros / target:.1%} of the decoder Linear weights are zero ({cfg.pattern}, "
            f"{cfg.method}); validation perplexity {one_shot.perplexity:.2f} right after one-shot "
            f"pruning, {after}. Its size on "
            f"disk is the compact format (`{self.name}/{COMPRESSED_FILE}`, "
            f"{metrics['compressed_bytes'] / 1e6:.2f} MB; the reloadable dense-format folder "
            "is larger)."
        )
        return ctx.result(
            metrics, notes=[note], perplexity_points={"one-shot": one_shot.perplexity}
        )


def block_sparse_choice(ctx: StageContext, cfg: SparsifyConfig) -> bool:
    """Whether the fine-tune runs `BlockSparseLinear` layers; the main process records it.

    A fresh run takes `cfg.block_sparse_on` for its device. A resumed run keeps the choice
    recorded (`CHOICE_FILE`) under the same config hash, so that its checkpoints, whose
    parameter names differ with the choice, load: `"auto"` follows the record (a run started
    on a GPU continues block-sparse on a CPU, through the PyTorch path, and one started on a
    CPU stays masked on a GPU).

    Raises:
        ConfigError: an explicit `true` / `false` that contradicts the recorded choice.
    """
    if not cfg.steps or cfg.pattern != "block":
        return False  # no fine-tune, or never block-sparse (the config refuses `true`)
    acc = ctx.accelerator
    chosen = cfg.block_sparse_on(acc.device.type)
    path = ctx.stage_dir / CHOICE_FILE
    recorded = _recorded_choice(path, ctx.config_hash) if ctx.resume else None
    if recorded is not None and recorded != chosen:
        value = cfg.block_sparse_layers
        if value != "auto":
            was, now = ("block-sparse", "masked") if recorded else ("masked", "block-sparse")
            raise ConfigError(
                "sparsify.block_sparse_layers",
                f"is {json.dumps(value)}, but this run's fine-tune started with "
                f"{json.dumps(recorded)} (`{path}`): its checkpoints hold {was} layers, which a "
                f"{now} fine-tune cannot load. Resume with the setting they were written with "
                f'("auto" follows it), or delete `{ctx.stage_dir / "checkpoints"}` and that '
                "file to restart the fine-tune",
            )
        acc.print(
            f'[sparsify] block_sparse_layers = "auto": {json.dumps(recorded)} as in the run '
            f"this one resumes (on {acc.device.type} it would be {json.dumps(chosen)})"
        )
        chosen = recorded
    if acc.is_main_process:
        ctx.stage_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(json.dumps({"block_sparse_layers": chosen, "config_hash": ctx.config_hash}))
        os.replace(tmp, path)
    return chosen


def _recorded_choice(path: Path, config_hash: str) -> bool | None:
    """The choice recorded in `path` under `config_hash`, or `None` (none, or another config's)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if data.get("config_hash") != config_hash:
        return None  # another config's: its checkpoints are discarded, not resumed
    return bool(data["block_sparse_layers"])


def _to_block_sparse(ctx: StageContext, model: torch.nn.Module, cfg: SparsifyConfig) -> int:
    """Convert the masked Linears to `BlockSparseLinear`; how many.

    A Linear left without any tile stays masked: its block-sparse tensors would be empty, and
    accelerate's checkpoints drop empty tensors (so a resume could not load them).
    """
    import re

    from sparse_kernels import masks, to_block_sparse_
    from sparse_kernels.block_sparse import resolve_backend

    acc = ctx.accelerator
    kept = [f"^{re.escape(name)}$" for name, mask in masks(model).items() if bool(mask.any())]
    if not kept:
        return 0
    layers = to_block_sparse_(model, block_size=cfg.block_size, targets=kept, backend="auto")
    backend = resolve_backend("auto", acc.device, cfg.block_size)
    acc.print(
        f"[sparsify] fine-tuning {len(layers)} block-sparse layers "
        f"({cfg.block_size}x{cfg.block_size} tiles, sparse-kernels' {backend} path)"
    )
    return len(layers)


def _save_one_shot(ctx: StageContext, model: torch.nn.Module, evaluation: Any) -> dict[str, Any]:
    from leanlm.train.checkpoint import save_model_folder
    from leanlm.train.model import count_parameters
    from sparse_kernels import save_pretrained_sparse

    acc = ctx.accelerator
    save_model_folder(ctx, lambda folder: save_pretrained_sparse(model, folder))
    return {
        "params": count_parameters(model),
        "tokens": 0,
        "val_loss": evaluation.loss,
        "val_perplexity": evaluation.perplexity,
        "processes": acc.num_processes,
    }
