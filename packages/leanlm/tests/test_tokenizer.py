import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from leanlm.config import DataConfig, TokenizerConfig
from leanlm.data import load_corpus
from leanlm.data import tokenizer as tok_module
from leanlm.data.tokenizer import EOS, PAD, load_or_train_tokenizer, tokenizer_key


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_corpus(DataConfig(max_bytes=200_000), cache_dir=tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    cache = tmp_path_factory.mktemp("tok")
    tokenizer, key = load_or_train_tokenizer(
        corpus, TokenizerConfig(vocab_size=400), cache_dir=cache
    )
    return tokenizer, key, cache


def test_vocab_size_and_special_tokens(trained):
    tokenizer, _, _ = trained
    assert len(tokenizer) == 400
    assert tokenizer.eos_token == EOS
    assert tokenizer.bos_token == EOS
    assert tokenizer.pad_token == PAD
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_cache_hit_does_not_retrain(trained, corpus, monkeypatch):
    tokenizer, key, cache = trained

    def fail(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tok_module, "train_tokenizer", fail)
    again, key2 = load_or_train_tokenizer(corpus, TokenizerConfig(vocab_size=400), cache_dir=cache)
    assert key2 == key
    assert again("def f(x): return x")["input_ids"] == tokenizer("def f(x): return x")["input_ids"]
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [key]  # no temp folders left


def test_key_depends_on_settings_and_corpus():
    base = tokenizer_key(TokenizerConfig(vocab_size=400), "corpus-a")
    assert tokenizer_key(TokenizerConfig(vocab_size=400), "corpus-a") == base
    assert tokenizer_key(TokenizerConfig(vocab_size=401), "corpus-a") != base
    assert tokenizer_key(TokenizerConfig(vocab_size=400, min_frequency=3), "corpus-a") != base
    assert tokenizer_key(TokenizerConfig(vocab_size=400), "corpus-b") != base


def test_reloads_with_auto_tokenizer(trained, tmp_path):
    tokenizer, _, _ = trained
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "import os\nprint(os.getcwd())  # ünïcödé ✓\n"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200))
def test_byte_level_round_trip_is_exact(trained, text):
    tokenizer, _, _ = trained
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
