import dataclasses

import pytest

from leanlm.config import (
    DataConfig,
    ModelConfig,
    PretrainConfig,
    PruneConfig,
    RunConfig,
    TokenizerConfig,
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer / datasets cache for the whole session (tokenizers train once)."""
    return tmp_path_factory.mktemp("leanlm-cache")


@pytest.fixture(scope="session")
def tiny_config(cache_dir):
    """A run that trains a ~40k-parameter Llama for a few seconds; `**changes` per section."""

    def make(*, pretrain=None, **changes):
        # sections other than `pretrain` are passed as whole config objects
        base = RunConfig(
            name="tiny",
            cache_dir=str(cache_dir),
            data=DataConfig(max_bytes=400_000, seq_len=32, eval_windows=8),
            tokenizer=TokenizerConfig(vocab_size=512),
            model=ModelConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            ),
            pretrain=PretrainConfig(
                steps=12,
                micro_batch_size=4,
                warmup_steps=2,
                eval_every=6,
                checkpoint_every=6,
                eval_batch_size=4,
            ),
        )
        if pretrain:
            changes["pretrain"] = dataclasses.replace(base.pretrain, **pretrain)
        return dataclasses.replace(base, **changes)

    return make


@pytest.fixture(scope="session")
def tiny_search():
    """A `[prune]` architecture search over shapes of the tiny model; `**changes` on top."""

    def make(**changes):
        space = {
            "search_hidden_size": (16, 24, 32),
            "search_intermediate_size": (32, 64),
            "search_num_hidden_layers": (1, 2),
            "search_tolerance": 0.1,
            "search_batch_size": 4,
            "calibration_samples": 16,
        }
        return PruneConfig(search=True, **{**space, **changes})

    return make
