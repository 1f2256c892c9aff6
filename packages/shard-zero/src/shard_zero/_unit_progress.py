"""Stage 3: how far backward has come through the units, the same on every rank.

A unit's gradient buckets may be reduced once its backward is over on every rank, also where a
parameter got no gradient (an expert that no token reached on this rank). When the gradient of
the output of the unit at position p of a forward arrives, autograd has run every node created
after that output (it runs a node only after every later-created node that reads its output,
and parameters' gradient accumulation first), so the units that ran only after position p are
done. With several forwards before one backward (DPO's chosen and rejected) a unit is done when
it is in every forward; a hook of a forward from before the last backward stops the inference.
"""

from __future__ import annotations

from shard_zero._unit import Unit


class BackwardProgress:
    """Each forward's unit order since the last backward, and the positions backward reached."""

    def __init__(self, units: list[Unit]) -> None:
        self._wrapped = set(units[1:])  # the root unit is not in the forward orders
        self._forward = 0
        self._orders: dict[int, list[Unit]] = {}
        self._reached: dict[int, int] = {}  # per forward, the lowest position reached
        self._seen: set[int] = set()  # the units whose backward began
        self._unknown = False

    def new_forward(self, order: list[Unit]) -> int:
        """Track `order` (appended to as the forward runs); returns the forward's number."""
        self._forward += 1
        self._orders[self._forward] = order
        return self._forward

    @property
    def forward(self) -> int:
        """The number of the forward running (or last run)."""
        return self._forward

    def order(self, forward: int) -> list[Unit]:
        """The units `forward` ran, in order (empty for one before the last backward)."""
        return self._orders.get(forward, [])

    def reach(self, unit: Unit, forward: int, position: int) -> bool:
        """The gradient of `unit`'s output at `position` of `forward` is here.

        Returns:
            Whether `unit`'s backward begins now (False if it began already: a tensor passed
            through every unit, as T5's position bias, reaches each unit's output last).
        """
        if forward in self._orders:
            self._reached[forward] = min(self._reached.get(forward, position), position)
        else:
            self._unknown = True
        first = unit.ident not in self._seen
        self._seen.add(unit.ident)
        return first

    def done(self) -> set[Unit] | None:
        """The wrapped units whose backward is over in every forward (None: unknown)."""
        if self._unknown:
            return None
        done = set(self._wrapped)
        for forward, order in self._orders.items():
            reached = self._reached.get(forward)
            done -= set(order if reached is None else order[: reached + 1])
        return done

    def clear(self) -> None:
        """The end of a backward, or a step: nothing tracked."""
        self._orders.clear()
        self._reached.clear()
        self._seen.clear()
        self._unknown = False
