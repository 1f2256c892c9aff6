"""Triton kernel tests on CPU at the tile sizes that ship on a GPU.

Kernel modules pick smaller tiles under the interpreter (`TRITON_INTERPRET=1`) to keep tests
fast, so an interpreter test alone never runs the GPU tiles (e.g. 256 columns). Here a second
copy of the module is imported as on a GPU, only to read its launch configuration, which is
then patched into the interpreted module for the duration of a test.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, cast

import pytest
import torch

#: Shapes that run the GPU tiles every way: one full 256-column tile (17 x 256, a partial last
#: 16-row block), a full and a partial tile (400), odd widths over several 64-column tiles
#: (257, 513) and a 3-D tensor (300 wide). See `assert_tiles_span_several`.
SHIPPED_TILE_SHAPES: list[tuple[int, ...]] = [(17, 256), (3, 400), (5, 257), (3, 513), (2, 5, 300)]


#: Shapes of kernel-vs-reference tests: power of two, odd, a batch with a partial tile, 1 x 1.
KERNEL_SHAPES = {"pow2": (16, 64), "odd": (13, 7), "tail_batch": (3, 37, 50), "tiny": (1, 1)}


def device_or_skip(kernels: ModuleType) -> str:
    """The device to test on ("cuda" with CUDA, else "cpu"); skips where `kernels` cannot run.

    `kernels` is an optimizer package's `_kernels` module (`available(device)`): on the CPU its
    kernels need the Triton interpreter (`TRITON_INTERPRET=1`).
    """
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernels.available(torch.device(dev)):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    return dev


def fused_kernel_marks(kernels: ModuleType, device: torch.device) -> list[pytest.MarkDecorator]:
    """`pytestmark` for a module of fused-kernel tests on `device`: marked `interpreter`.

    `kernels` is an optimizer package's `_kernels` module (`HAS_TRITON`, `available(device)`);
    the tests are skipped without Triton, or where its kernels cannot run on `device` (CUDA, or
    the CPU under `TRITON_INTERPRET=1`).
    """
    return [
        pytest.mark.interpreter,
        pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed"),
        pytest.mark.skipif(
            not kernels.available(device),
            reason=f"the Triton kernels cannot run on {device.type} (CPU: TRITON_INTERPRET=1)",
        ),
    ]


def import_as_on_gpu(module_names: Sequence[str]) -> dict[str, ModuleType]:
    """Fresh copies of `module_names` imported without `TRITON_INTERPRET`, in the given order.

    While the copies are made, each finished copy stands in for its module (in `sys.modules`
    and as its package's attribute), so a later module that takes constants from an earlier
    one (`from pkg import _kernels as k; BLOCK = k.BLOCK`) gets their GPU values. Everything is
    restored afterwards; the copies are not importable. Their `@triton.jit` kernels cannot run
    on CPU: use them only to read launch configurations.
    """
    # the live (interpreted) modules first, with everything they import: a module the copies
    # import as a side effect would otherwise stay in `sys.modules` uninterpreted, and a later
    # live import would pick up its GPU kernels
    for name in module_names:
        importlib.import_module(name)
    copies: dict[str, ModuleType] = {}
    restore: list[tuple[str, ModuleType | None, ModuleType | None, str, object]] = []
    missing = object()
    saved_env = os.environ.pop("TRITON_INTERPRET", None)
    try:
        for name in module_names:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                raise ModuleNotFoundError(name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            copies[name] = module
            parent_name, _, child = name.rpartition(".")
            parent = sys.modules.get(parent_name)
            old_attr = getattr(parent, child, missing) if parent is not None else missing
            restore.append((name, sys.modules.get(name), parent, child, old_attr))
            sys.modules[name] = module
            if parent is not None:
                setattr(parent, child, module)
    finally:
        if saved_env is not None:
            os.environ["TRITON_INTERPRET"] = saved_env
        for name, old_module, parent, child, old_attr in reversed(restore):
            if old_module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old_module
            if parent is not None:
                if old_attr is missing:
                    delattr(parent, child)
                else:
                    setattr(parent, child, old_attr)
    return copies


@contextmanager
def shipped_launch_configs(module_names: Sequence[str]) -> Iterator[dict[str, ModuleType]]:
    """Patch each interpreted module's tile constants to their GPU values, for a test.

    A tile constant is a public module-level int (not a bool) whose value differs between the
    module as imported here and its copy imported as on a GPU (e.g. `BLOCK_M = 64 if
    interpreting else 256`). Launchers and `launch_config`-style helpers read them at call
    time, so they then launch exactly the GPU's tiles. List modules after those they take
    constants from. Yields the GPU copies by module name; raises if no constant differs in
    any module (the patch would test nothing new).
    """
    copies = import_as_on_gpu(module_names)
    saved: list[tuple[ModuleType, str, object]] = []
    try:
        for name, copy in copies.items():
            live = importlib.import_module(name)
            for attr, value in vars(copy).items():
                current = getattr(live, attr, None)
                if (
                    not attr.startswith("_")
                    and type(value) is int
                    and type(current) is int
                    and current != value
                ):
                    saved.append((live, attr, current))
                    setattr(live, attr, value)
        if not saved:
            raise AssertionError(f"{list(module_names)}: no tile constant differs on a GPU")
        yield copies
    finally:
        for live, attr, value in reversed(saved):
            setattr(live, attr, value)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits), for fp32 `x`."""
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def check_fused_matches_torch(
    make_opt: Callable[[list[torch.Tensor], str], torch.optim.Optimizer],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    *,
    steps: int = 3,
    seed: int = 0,
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """`make_opt(params, "triton")` follows `make_opt(params, "torch")` step by step.

    The PyTorch path runs on fp32 copies of the parameters (for bf16/fp16 parameters that is its
    own math before the final rounding), on fresh random heteroscedastic gradients in `dtype`.
    After every step, the fused parameters must equal the reference (fp32: rtol 1e-5; bf16:
    within one bf16 ulp (+ rtol 1e-5) of the unrounded value, which covers round-to-nearest, the
    interpreter's truncation and stochastic rounding) and every state tensor must match (rtol
    1e-5 of its largest entry). The reference then continues from the fused parameters, so
    the comparison stays per step.

    Returns the fused and the reference optimizer.
    """
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    fused_params = [p.clone().requires_grad_() for p in init]
    ref_params = [p.float().requires_grad_() for p in init]
    fused, ref = make_opt(fused_params, "triton"), make_opt(ref_params, "torch")
    for step in range(steps):
        for a, b in zip(fused_params, ref_params, strict=True):
            g = torch.randn(a.shape, generator=gen)
            g *= torch.rand(a.shape[:-1], generator=gen).add_(0.1).unsqueeze(-1)
            g *= 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
            a.grad, b.grad = g.to(dtype), g.to(dtype).float()
        fused.step()
        ref.step()
        for i, (a, b) in enumerate(zip(fused_params, ref_params, strict=True)):
            got, want = a.detach().float(), b.detach()
            where = f"step {step} param {i} {tuple(a.shape)} {dtype}"
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=where)
            else:
                # one ulp, plus the fp32 difference of the unrounded values (rtol 1e-5)
                bound = _bf16_ulp(want) + 1e-5 * want.abs() + 1e-12
                excess = float(((got - want).abs() - bound).max())
                assert excess <= 0, f"{where}: off by more than one bf16 ulp (+{excess:.3g})"
            for key, value in ref.state[b].items():
                other = fused.state[a][key]
                if isinstance(value, torch.Tensor):
                    atol = 1e-5 * float(value.abs().max())
                    torch.testing.assert_close(
                        other.float(), value.float(), rtol=1e-5, atol=atol, msg=f"{where} {key}"
                    )
                else:
                    assert other == value, (where, key)
            b.data.copy_(a.detach().float())
    return fused, ref


def check_low_precision_state(
    make_opt: Callable[[list[torch.Tensor], str], Any],
    device: str | torch.device,
    shapes: Sequence[tuple[int, ...]],
    *,
    steps: int = 3,
) -> None:
    """A fused optimizer with a bf16 or int8 `exp_avg` against its PyTorch path, `steps` steps.

    `make_opt(params, backend)` ("triton" / "torch"); both get the same stochastic-rounding
    seed, fp32 parameters and fresh gradients, each its own trajectory. Rounding m to bf16
    (nearest on a GPU) or to int8 codes turns fp32 differences of a few ulp into a whole bf16
    ulp or code step where a value sits at a rounding boundary: rare, so the check counts them.
    Codes: at most one step apart, in < 0.1% of the elements, scales within rtol 1e-4; bf16 m:
    within one bf16 ulp; p: < 0.1% of the elements off by more than fp32 rounding, and none by
    more than moved codes can do (a code step is <= 2/127 of its block's absmax).
    """
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(device) for s in shapes]
    fused = [t.clone().requires_grad_() for t in init]
    eager = [t.clone().requires_grad_() for t in init]
    opt_f, opt_e = make_opt(fused, "triton"), make_opt(eager, "torch")
    opt_f._sr_seed = opt_e._sr_seed  # the same noise for the codes
    for _ in range(steps):
        for a, b in zip(fused, eager, strict=True):
            g = torch.randn(a.shape, generator=gen).to(device)
            a.grad, b.grad = g, g.clone()
        opt_f.step()
        opt_e.step()
    for a, b, p0 in zip(fused, eager, init, strict=True):
        where = f"{tuple(a.shape)}"
        st_f, st_e = opt_f.state[a], opt_e.state[b]
        m_f, m_e = st_f["exp_avg"], st_e["exp_avg"]
        assert m_f.dtype == m_e.dtype, where
        if m_f.dtype == torch.int8:
            moved = (m_f.int() - m_e.int()).abs()
            assert moved.max() <= 1, where
            assert moved.float().mean() < 1e-3, where
            torch.testing.assert_close(
                st_f["exp_avg_scale"], st_e["exp_avg_scale"], rtol=1e-4, atol=0, msg=where
            )
        elif m_f.dtype == torch.bfloat16:
            excess = (m_f.float() - m_e.float()).abs() - _bf16_ulp(m_e.float())
            assert float(excess.max()) <= 0, where
        diff, moved_by = (a - b).detach().abs(), (b - p0).detach().abs().max()
        assert (diff > 1e-6 + 1e-5 * b.detach().abs()).float().mean() < 1e-3, where
        assert diff.max() <= steps * 4 / 127 * moved_by + 1e-6, where


def shipped_tiles_fixture(module_names: Sequence[str]) -> Any:
    """A pytest fixture `gpu_tiles`: a test runs under `shipped_launch_configs(module_names)`.

    Assign it to `gpu_tiles` in a test module; it yields the GPU copies by module name.
    """

    @pytest.fixture
    def gpu_tiles() -> Iterator[dict[str, ModuleType]]:
        with shipped_launch_configs(module_names) as copies:
            yield copies

    return gpu_tiles


def assert_tiles_span_several(
    live: ModuleType, gpu: ModuleType, shapes: Sequence[tuple[int, ...]]
) -> None:
    """The patched tiles are the GPU's, and the widths of `shapes` span several.

    Under `shipped_launch_configs`: `live.launch_config(width)` is the GPU copy's for every
    last dimension in `shapes`, and those widths run one full 256-column tile, a full and a
    partial tile, and several narrow (unaligned) tiles.
    """
    widths = {s[-1]: live.launch_config(s[-1]) for s in shapes}
    assert widths == {w: gpu.launch_config(w) for w in widths}
    tile = {w: bm for w, (bm, _) in widths.items()}
    assert max(tile.values()) == 256  # the aligned GPU tile (64 in the interpreter)
    assert any(w == tile[w] for w in tile if w % 16 == 0)  # exactly one full tile
    assert any(w > tile[w] and w % tile[w] for w in tile if w % 16 == 0)  # full + partial
    assert any(w > 2 * tile[w] for w in tile if w % 16)  # several narrow tiles


def check_fused_matches_torch_multi(
    optimizer: Callable[..., Any],
    kw: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    *,
    multi_tensor: bool,
    steps: int = 2,
) -> None:
    """`check_fused_matches_torch` with the optimizer's `multi_tensor` switch set.

    The optimizer is `optimizer(params, backend=..., **kw)`; the 2-D matrices must have taken
    the batched step (its tables are cached) exactly when `multi_tensor`.
    """

    def make(params: list[torch.Tensor], backend: str) -> torch.optim.Optimizer:
        opt = optimizer(params, backend=backend, **kw)
        opt.multi_tensor = multi_tensor
        return cast(torch.optim.Optimizer, opt)

    fused, _ = check_fused_matches_torch(make, shapes, dtype, steps=steps)
    assert bool(fused._multi_cache) == multi_tensor  # type: ignore[attr-defined]


def shipped_tiles_parity_test(
    optimizer: Callable[..., Any], configs: dict[str, dict[str, Any]], multi: Sequence[bool]
) -> Callable[..., None]:
    """A test that the fused step matches the PyTorch path at the shipped tiles, for a module.

    `check_fused_matches_torch_multi(optimizer, configs[config], SHIPPED_TILE_SHAPES, dtype,
    multi_tensor=...)`, parametrized over fp32 and bf16 parameters, the names of `configs` (the
    optimizer's keyword arguments) and `multi` (its `multi_tensor` switch), under the test
    module's `gpu_tiles` fixture (`shipped_tiles_fixture`). Assign it to a `test_...` name.
    """

    @pytest.mark.parametrize("multi_tensor", multi)
    @pytest.mark.parametrize("config", list(configs))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test(
        gpu_tiles: dict[str, ModuleType], dtype: torch.dtype, config: str, multi_tensor: bool
    ) -> None:
        check_fused_matches_torch_multi(
            optimizer, configs[config], SHIPPED_TILE_SHAPES, dtype, multi_tensor=multi_tensor
        )

    return test


@contextmanager
def no_host_sync() -> Iterator[None]:
    """CUDA work inside raises on any device -> host synchronization (torch's sync debug mode)."""
    torch.cuda.synchronize()  # what came before may sync; only the block is checked
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
