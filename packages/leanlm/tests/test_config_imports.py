"""Loading and checking a config loads no torch (nor Triton, numpy or the training stack).

`leanlm run bad.toml` should report a bad key in well under a second; importing torch alone
takes longer than that. The stage modules import torch, prune-distill's and sparse-kernels'
training code inside `run`, and the two libraries load their exports on first use, so their
config classes (`prune_distill.DistillConfig`, `sparse_kernels.SparsityConfig`) come without
torch.
"""

import subprocess
import sys

from leanlm.config import dumps_toml
from leanlm.presets import PRESETS

HEAVY = ("torch", "triton", "numpy", "transformers", "accelerate", "datasets", "tokenizers")


def _loaded_after(code):
    """The `HEAVY` modules loaded by `code` in a fresh interpreter."""
    probe = f"{code}\nimport sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1], done.stderr


def test_a_full_config_loads_without_torch(tmp_path):
    # every stage's section, with the library configs they wrap built and checked
    path = tmp_path / "full.toml"
    path.write_text(dumps_toml(PRESETS["default"]()))
    loaded, _ = _loaded_after(
        "from leanlm.config import load_toml\n"
        f"config = load_toml({str(path)!r})\n"
        "assert config.distill.options.temperature > 0\n"
        "assert config.sparsify.sparsity_config.pattern\n"
    )
    assert loaded == "[]"


def test_a_bad_key_is_reported_without_torch(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[sparsify]\npatern = '2:4'\n")
    loaded, stderr = _loaded_after(
        "from leanlm.cli import main\n"
        f"assert main(['run', {str(path)!r}, '--out', {str(tmp_path / 'out')!r}]) == 2\n"
    )
    assert "config key `sparsify.patern`: unknown key; did you mean `pattern`?" in stderr
    assert loaded == "[]"
    for value, key in (("pattern = '5:4'", "sparsify.pattern"), ("temperature = 0", "distill")):
        path.write_text(f"[{key.split('.')[0]}]\n{value}\n")
        loaded, stderr = _loaded_after(
            f"from leanlm.cli import main\nassert main(['run', {str(path)!r}]) == 2\n"
        )
        assert f"config key `{key}" in stderr  # the library's check, named by our key
        assert loaded == "[]"
