"""`leanlm plan`: each stage's peak bytes per process at full size, from `config.json` alone."""

import dataclasses
import json
from pathlib import Path

import pytest

from leanlm.cli import main
from leanlm.config import (
    DataConfig,
    DistillConfig,
    ModelConfig,
    PruneConfig,
    RunConfig,
    SparsifyConfig,
    dumps_toml,
    load_toml,
)
from leanlm.plan import plan
from shard_zero.simulate import PRESETS

CONFIGS = Path(__file__).parents[1] / "configs"
GiB = 2**30
# the published Llama-3-8B config's shapes (vocab 128256, hidden 4096, MLP 14336, 32 layers,
# 32 heads / 8 KV heads), as a bf16 checkpoint's config.json
LLAMA_3_8B = PRESETS["llama-3-8b"] | {
    "architectures": ["LlamaForCausalLM"],
    "torch_dtype": "bfloat16",
}


def _run(folder, *, seq_len, prune, teacher="cached", top_k=1024, micro_batch_size=1):
    train = {
        "steps": 10,
        "warmup_steps": 1,
        "micro_batch_size": micro_batch_size,
        "grad_accum_steps": 2,
        "activation_checkpointing": True,
    }
    return RunConfig(
        init_model=str(folder),
        stages=("prune", "distill", "sparsify"),
        mixed_precision="bf16",
        data=DataConfig(seq_len=seq_len),
        model=ModelConfig(max_position_embeddings=seq_len),
        prune=PruneConfig(calibration_batch_size=1, **prune),
        distill=DistillConfig(teacher_stage="init", teacher=teacher, top_k=top_k, **train),
        sparsify=SparsifyConfig(
            calibration_samples=4, calibration_batch_size=2, eval_batch_size=2, **train
        ),
    )


def _model_folder(tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))  # no weights, no tokenizer
    return folder


def test_llama_3_8b_minitron_recipe_fits_one_80gb_gpu(tmp_path, capsys):
    # configs/llama3-8b-minitron.toml: Llama-3-8B pruned to Minitron-4B width, distilled from
    # the cached teacher with CAME, then 2:4 with a sparse fine-tune; bf16 autocast,
    # activation checkpointing, 1 process
    recipe = load_toml(CONFIGS / "llama3-8b-minitron.toml")
    assert recipe.distill.teacher == "cached"
    assert recipe.distill.activation_checkpointing
    assert recipe.sparsify.activation_checkpointing
    folder = _model_folder(tmp_path, LLAMA_3_8B)
    path, out = tmp_path / "recipe.toml", tmp_path / "plan.json"
    path.write_text(dumps_toml(dataclasses.replace(recipe, init_model=str(folder))))
    argv = ["plan", str(path), "--processes", "1", "--json", str(out), "--layers", "2,3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    stages = json.loads(out.read_text())["stages"]
    assert list(stages) == ["prune", "distill", "sparsify"]
    parts = ["weights", "gradients", "optimizer_state", "activations", "teacher"]
    parts += ["cache_buffers", "other"]
    for name, stage in stages.items():
        assert 0 < stage["peak_bytes_per_process"] <= 80 * GiB, (name, stage)
        assert all(stage[part] >= 0 for part in parts), (name, stage)
        assert sum(stage[part] for part in parts) == stage["peak_bytes_per_process"], name
        assert name in printed
    for stage in stages.values():  # the peak is the largest phase's (scoring or training)
        peaks = [phase["peak_bytes_per_process"] for phase in stage["phases"].values()]
        assert stage["peak_bytes_per_process"] == max(peaks)
    # the student: hidden 3072, MLP 9216, fp32 weights and gradients, no teacher in memory
    distill = stages["distill"]
    assert 4.4e9 < distill["model_params"] < 4.6e9
    assert distill["weights"] == 4 * distill["model_params"]
    assert distill["gradients"] == 4 * distill["model_params"]
    assert distill["teacher"] == 0
    assert distill["cache_buffers"] == 4096 * 64 * (4 + 8)  # fp32 values, int64 indices
    assert distill["peak_bytes_per_process"] > 3 * distill["weights"]  # + CAME's state
    # importance scoring: the bf16 8B model and one calibration forward (logits and statistics);
    # then the pruned model's validation pass with both models held
    prune = stages["prune"]
    assert prune["model_params"] == 8_030_261_248
    scoring = prune["phases"]["scoring"]
    assert scoring["weights"] == 2 * 8_030_261_248
    logits = 4096 * 128256 * 2  # one sequence's bf16 logits
    assert scoring["peak_bytes_per_process"] > scoring["weights"] + logits
    assert prune["scoring_peak_bytes_per_process"] == scoring["peak_bytes_per_process"]
    evaluate = prune["phases"]["evaluate"]
    assert evaluate["weights"] == 2 * (8_030_261_248 + distill["model_params"])
    # one-shot Wanda on the distilled (fp32) student, layer by layer: the weights, the hidden
    # states of all 128 calibration sequences (fp32) and one layer's statistics
    sparsify = stages["sparsify"]
    scoring = sparsify["phases"]["scoring"]
    assert scoring["weights"] == distill["weights"]
    hidden = 128 * 4096 * 3072 * 4
    assert scoring["peak_bytes_per_process"] > scoring["weights"] + hidden
    assert sparsify["scoring_peak_bytes_per_process"] == scoring["peak_bytes_per_process"]
    phases = {"scoring", "one_shot_evaluate", "forward", "backward", "optimizer", "evaluate"}
    assert set(sparsify["phases"]) == phases


@pytest.mark.parametrize("teacher", ["cached", "online"])
def test_extrapolation_by_layers_equals_the_full_fake_run(tmp_path, teacher):
    small = LLAMA_3_8B | {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    folder = _model_folder(tmp_path, small)
    prune = {"hidden_size": 128, "intermediate_size": 256}
    run = _run(folder, seq_len=128, prune=prune, teacher=teacher, top_k=64, micro_batch_size=2)
    if teacher == "online":  # (sparsify does not depend on the teacher: planned once)
        run = dataclasses.replace(run, stages=("prune", "distill"))
    full, scaled = plan(run), plan(run, layers=(2, 3))
    for name in full:
        assert scaled[name].peak_bytes_per_process == full[name].peak_bytes_per_process, name
        assert scaled[name].parts == full[name].parts, name
        assert scaled[name].model_params == full[name].model_params, name
    # bf16: 4 x (q, o 256x256; k, v 256x128; MLP 3 x 256x512; 2 norms) + final norm + 2 x embed
    layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256
    teacher_bytes = 2 * (4 * layer + 256 + 2 * 1024 * 256)
    assert full["distill"].parts["teacher"] == (teacher_bytes if teacher == "online" else 0)


def test_plan_needs_the_config_only(tmp_path, capsys):
    # (the other tests plan from folders without weights or tokenizer); a foreign
    # architecture stops it in one line
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(
        json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    )
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(RunConfig(init_model=str(foreign), stages=("prune",))))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{str(foreign)!r} holds an unsupported architecture (FooForCausalLM" in err
