"""`ZeroOptimizer`: the wrapped optimizer's step, plus gradient reduction and weight gathering."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from shard_zero._engine import CLIP_IDENT, ZeroEngine


class ZeroOptimizer(Optimizer):
    """Steps the optimizer built over the local fp32 shards and keeps the model in sync.

    It shares `param_groups`, `state` and `defaults` with the wrapped optimizer (so LR schedulers
    work unchanged). `step()` first finishes gradient reduction, then steps the shards, then makes
    the model's parameters equal the updated shards (all-gather in stages 1-2; stage 3 gathers
    lazily in the next forward).

    Attributes:
        optimizer: the optimizer `make_optimizer` built over the shards.
    """

    def __init__(self, optimizer: Optimizer, engine: ZeroEngine) -> None:
        # Optimizer.__init__ is not called (it would add the groups anew): groups and state are
        # the wrapped ones. What else it sets up is done here: the hook dicts, and the step
        # wrapped by torch's `profile_hook_step`, which runs the global and this optimizer's
        # step hooks around the whole step (reduction, step and parameter update)
        self.optimizer = optimizer
        self.engine = engine
        self._share()
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def _share(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Reduce outstanding gradients, step the shards, then update the model's parameters."""
        if closure is not None:
            raise ValueError("`closure` is not supported by shard-zero (run backward yourself)")
        self.engine.model_hooks.check_parameters()  # a module replaced after `prepare` raises
        self.engine.reduce_leftover()
        self.engine.check_step()  # before the weights change: a diverged step raises here
        self.engine.release_params()  # stages 1-2, mixed precision: refilled by push_params
        try:
            with _no_global_step_hooks():  # they run around this step, once
                loss = self.optimizer.step()
        finally:
            self.engine.push_params()
        self.engine.comm.end_step()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the optimizer steps the shards `prepare` made (see the message)."""
        raise ValueError(
            "shard-zero: `add_param_group` after `prepare` is not supported: the optimizer "
            "steps the fp32 shards `prepare` made of the parameters trainable then, and a new "
            "group's parameters would get no reduced gradient (each rank would train its own "
            "copy). Make them trainable before `prepare` and give them their group in "
            "`make_optimizer`; freezing a parameter later (`requires_grad_(False)`) is fine"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and any gradient still accumulated under `no_sync()`."""
        self.engine.wait_for_host()  # offload: no copy into the host gradients is pending
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.engine.clear_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the *whole* gradient, across all ranks.

        Same formula as `torch.nn.utils.clip_grad_norm_` on the unsharded model: the gradients
        are scaled by `min(1, max_norm / (total_norm + 1e-6))`.

        Returns:
            The total (global) gradient norm before clipping, a 0-dim fp32 tensor.
        """
        engine = self.engine
        engine.reduce_leftover()
        if norm_type <= 0:
            raise ValueError(f"`norm_type` ({norm_type}) must be > 0 (or math.inf)")
        sharded = [e.master.grad for e in engine.sharded if e.master.grad is not None]
        replicated = [e.master.grad for e in engine.replicated if e.master.grad is not None]
        if engine.rank != 0:
            replicated = []  # every rank holds the same replicated gradients: count them once
        grads = [g for g in sharded + replicated if g.numel() > 0]
        # the norm is taken where the gradients are (the host with `offload_optimizer`)
        where = engine.entries[0].master.device if engine.entries else engine.device
        if math.isinf(norm_type):
            local = (
                torch.stack([g.abs().max() for g in grads]).max()
                if grads
                else torch.zeros((), device=where)
            )
            total = local.float().reshape(1).to(engine.device, copy=True)
            engine.comm.all_reduce(total, ident=CLIP_IDENT, op=torch.distributed.ReduceOp.MAX)
            total_norm = total[0]
        else:
            local = (
                torch.stack([g.float().abs().pow(norm_type).sum() for g in grads]).sum()
                if grads
                else torch.zeros((), device=where)
            )
            total = local.reshape(1).to(engine.device, copy=True)
            engine.comm.all_reduce(total, ident=CLIP_IDENT)
            total_norm = total[0].pow(1.0 / norm_type)
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).to(where)
        for e in engine.entries:
            if e.master.grad is not None:
                e.master.grad.mul_(coef)
        return total_norm

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (this rank's shards only; see `save_checkpoint`).

        This optimizer's state-dict hooks run around it, as `Optimizer.state_dict` runs them.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self.optimizer.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by `state_dict()` on the same rank and world size.

        This optimizer's load-state-dict hooks run around it, as in `Optimizer`.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.optimizer.load_state_dict(state_dict)
        self._share()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.engine.stage}, {self.optimizer!r})"


@contextmanager
def _no_global_step_hooks() -> Iterator[None]:
    """Hide torch's global optimizer step hooks from the wrapped optimizer's own step.

    `profile_hook_step` runs them around `ZeroOptimizer.step`; without this they would run a
    second time around the wrapped optimizer's step inside it, with that optimizer as argument
    (torch's `ZeroRedundancyOptimizer` does), so an EMA or logging hook would act twice.
    """
    # empty dicts in their place (not the real ones cleared): a handle removed inside the step
    # refers to the real dict, so it stays removed; one registered inside is moved over after
    # those registered before it
    hooks = torch_optimizer
    saved = (hooks._global_optimizer_pre_hooks, hooks._global_optimizer_post_hooks)
    hooks._global_optimizer_pre_hooks = OrderedDict()
    hooks._global_optimizer_post_hooks = OrderedDict()
    try:
        yield
    finally:
        added = (hooks._global_optimizer_pre_hooks, hooks._global_optimizer_post_hooks)
        hooks._global_optimizer_pre_hooks, hooks._global_optimizer_post_hooks = saved
        saved[0].update(added[0])
        saved[1].update(added[1])
