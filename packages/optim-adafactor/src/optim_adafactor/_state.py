"""Lossless state dicts and the stochastic-rounding randomness of `base.FactoredOptimizer`.

`LosslessState` (the base class of `FactoredOptimizer`) keeps statistics in fp32 (float64 for
float64 parameters) and restores them bit-exact, undoing `torch.optim.Optimizer`'s cast of state
to the parameter's dtype. It also saves the stochastic-rounding seed: a step's noise depends
only on the seed, the step count and the parameter's position (`_kernel_seed`), so a resumed
run continues it exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

#: Top-level state-dict key holding the stochastic-rounding seed.
RNG_STATE_KEY = "stochastic_rounding_rng"


class LosslessState(Optimizer):
    """State dicts without precision loss, and the stochastic-rounding seed and generators.

    `FactoredOptimizer` sets `_sr_seed` and `_generators` in its constructor and provides the
    hooks `_parse_group`, `_state_dtype` and `_convert_loaded_state` (and may refine
    `_convert_loaded_group` and `_adapt_loaded_state`).
    """

    _sr_seed: int
    _generators: dict[torch.device, torch.Generator]

    if TYPE_CHECKING:

        def _parse_group(self, group: dict[str, Any], check: Any = ...) -> Any: ...

        def _state_dtype(self, key: str, p: Tensor, opts: Any) -> torch.dtype: ...

        def _convert_loaded_state(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus the stochastic-rounding seed."""
        sd = super().state_dict()
        sd[RNG_STATE_KEY] = {"seed": self._sr_seed}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict without losing precision.

        `torch.optim.Optimizer.load_state_dict` casts every state tensor to its parameter's
        dtype (bf16/fp16 state loses bits; fp16 can flush small statistics to zero). The state
        tensors are therefore taken from `state_dict` as saved and converted once, to the
        dtypes `step()` keeps them in. The stochastic-rounding seed is restored when the state
        dict carries it (older state dicts' generator states are not needed: the noise is
        reseeded per step).
        """
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        saved_state = state_dict["state"]
        raw = {pid: dict(saved_state[pid]) for pid in saved_ids if pid in saved_state}
        super().load_state_dict(state_dict)  # validates the groups, fills self.state
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in raw:
                state = self.state[p]
                for key, value in raw[pid].items():
                    if isinstance(value, Tensor) and key != "step":
                        state[key] = value  # as saved: converted below, exactly once
        self._normalise_state()
        self._load_rng(state_dict.get(RNG_STATE_KEY))

    def _normalise_state(self) -> None:
        for group in self.param_groups:
            self._convert_loaded_group(group)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            opts = self._parse_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                self._convert_loaded_state(state)
                self._adapt_loaded_state(p, state, opts)
                step = state.get("step", 0)
                state["step"] = int(step.item()) if isinstance(step, Tensor) else int(step)
                for key, value in state.items():
                    if isinstance(value, Tensor) and key != "step":
                        dtype = self._state_dtype(key, p, opts)
                        state[key] = value.to(device=p.device, dtype=dtype)

    def _convert_loaded_group(self, group: dict[str, Any]) -> None:
        """Hook: rename the options of a loaded foreign param group, in place (no-op).

        Runs before the options the group lacks are filled in from the constructor's defaults.
        """

    def _adapt_loaded_state(self, p: Tensor, state: dict[str, Any], opts: Any) -> None:
        """Hook: convert a loaded parameter's state to `opts` before the dtype casts (no-op)."""

    def _load_rng(self, saved: dict[str, Any] | None) -> None:
        if saved is not None:
            self._sr_seed = int(saved["seed"])

    def _generator(self, device: torch.device) -> torch.Generator:
        """This optimizer's generator for stochastic rounding on `device` (reseeded per use)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen
