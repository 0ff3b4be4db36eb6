"""Server optimizers over ortckpt's FedAvg: ``FedAvgM``, ``FedAdam`` and ``FedYogi``, with
Flower's arguments and update rules (flwr.serverapp.strategy's classes of the same names),
applied to the average that :class:`~ortckpt.flower.FedAvg` computes. Their state (momentum,
first and second moments) is kept as the optimizer group ``"server"`` of each round's
checkpoint (``momentum0``: FedAvgM's momentum or the first moment, ``momentum1``: the second
moment; ``step``: the round), so a resumed run continues them.

The update runs in NumPy on the floating-point tensors, in their own type as Flower's does
(one model, not N); integer and bool tensors are the average's (Flower's would make them floats).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..checkpoint_state import OptimizerGroup
from .convert import array_of, flwr_app, values_of
from .strategy import FedAvg

GROUP = "server"


def _is_float(values: np.ndarray) -> bool:
    return values.dtype.kind == "f" or values.dtype.name == "bfloat16" or values.dtype.name.startswith("float8")


class _ServerOptimizer(FedAvg):  # type: ignore[misc]
    """FedAvg's average, then ``step``: the new global model from the current one and the average."""

    # The learning rate stored as the group's initial_learning_rate.
    learning_rate: float = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.current: dict[str, np.ndarray] | None = None
        # state name ("momentum0", "momentum1") -> parameter -> values
        self.moments: dict[str, dict[str, np.ndarray]] = {}
        self.round = 0

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Iterable[Any]:
        self.current = {key: values_of(array, key) for key, array in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> tuple[Any, Any]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None or self.current is None:
            return arrays, metrics
        average = {key: values_of(array, key) for key, array in arrays.items()}
        floats = [key for key, values in average.items() if _is_float(values)]
        new = self.step(server_round, {k: self.current[k] for k in floats}, {k: average[k] for k in floats})
        self.round = server_round
        record = flwr_app.ArrayRecord()
        for key, array in arrays.items():
            record[key] = array_of(np.asarray(new[key], dtype=average[key].dtype)) if key in new else array
        return record, metrics

    def step(self, server_round: int, current: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict:
        """The server optimizer's update of the float tensors from ``current`` given the round's
        ``average``: each subclass's rule (FedAvgM, FedAdam, FedYogi); this base has none."""
        raise NotImplementedError(f"{type(self).__name__} defines no server update rule")

    def server_optimizer_state(self) -> dict[str, OptimizerGroup]:
        if not self.moments:
            return {}
        momentums: dict[str, dict[str, Any]] = {}
        for name, by_key in self.moments.items():
            for key, values in by_key.items():
                momentums.setdefault(key, {})[name] = values
        return {GROUP: OptimizerGroup(self.round, self.learning_rate, momentums)}

    def restore_server_optimizer(self, groups: dict[str, OptimizerGroup]) -> None:
        group = groups.get(GROUP)
        if group is None:
            return
        self.round = group.step
        self.moments = {}
        for key, by_name in group.momentums.items():
            for name, values in by_name.items():
                self.moments.setdefault(name, {})[key] = np.array(values)  # (a copy: off the loaded file)


class FedAvgM(_ServerOptimizer):
    """Flower's FedAvgM: ``server_learning_rate`` and ``server_momentum`` over the pseudo-gradient
    ``current - average`` (the momentum starts as the first pseudo-gradient)."""

    def __init__(self, *args: Any, server_learning_rate: float = 1.0, server_momentum: float = 0.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_learning_rate, self.server_momentum = server_learning_rate, server_momentum
        self.learning_rate = server_learning_rate

    def step(self, server_round: int, current: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict:
        if self.server_momentum == 0.0 and self.server_learning_rate == 1.0:
            return average
        gradient = {k: current[k] - average[k] for k in average}
        if self.server_momentum > 0.0:
            momentum = self.moments.get("momentum0")
            if momentum is None:
                momentum = gradient
            else:
                momentum = {k: self.server_momentum * momentum[k] + gradient[k] for k in gradient}
            self.moments["momentum0"] = momentum
            gradient = momentum
        return {k: current[k] - self.server_learning_rate * gradient[k] for k in gradient}


class _FedOpt(_ServerOptimizer):
    def __init__(
        self,
        *args: Any,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.eta, self.eta_l, self.beta_1, self.beta_2, self.tau = eta, eta_l, beta_1, beta_2, tau
        self.learning_rate = eta

    def moments_of(self, delta: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The first moment updated (Flower's FedOpt._compute_deltat_and_mt), and the second as it was."""
        m = self.moments.get("momentum0") or {k: np.zeros_like(v) for k, v in delta.items()}
        m = {k: self.beta_1 * v + (1 - self.beta_1) * delta[k] for k, v in m.items()}
        v = self.moments.get("momentum1") or {k: np.zeros_like(x) for k, x in delta.items()}
        return m, v


class FedAdam(_FedOpt):
    """Flower's FedAdam (``eta``, ``eta_l``, ``beta_1``, ``beta_2``, ``tau``)."""

    def step(self, server_round: int, current: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict:
        delta = {k: average[k] - current[k] for k in average}
        m, v = self.moments_of(delta)
        v = {k: self.beta_2 * x + (1 - self.beta_2) * (delta[k] ** 2) for k, x in v.items()}
        self.moments = {"momentum0": m, "momentum1": v}
        eta_norm = (
            self.eta
            * np.sqrt(1 - np.power(self.beta_2, server_round + 1.0))
            / (1 - np.power(self.beta_1, server_round + 1.0))
        )
        return {k: x + eta_norm * m[k] / (np.sqrt(v[k]) + self.tau) for k, x in current.items()}


class FedYogi(_FedOpt):
    """Flower's FedYogi (``eta=1e-2``, ``eta_l=0.0316``, ``beta_1``, ``beta_2``, ``tau=1e-3``)."""

    def __init__(self, *args: Any, eta: float = 1e-2, eta_l: float = 0.0316, **kwargs: Any) -> None:
        super().__init__(*args, eta=eta, eta_l=eta_l, **kwargs)

    def step(self, server_round: int, current: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict:
        delta = {k: average[k] - current[k] for k in average}
        m, v = self.moments_of(delta)
        v = {k: x - (1.0 - self.beta_2) * (delta[k] ** 2) * np.sign(x - delta[k] ** 2) for k, x in v.items()}
        self.moments = {"momentum0": m, "momentum1": v}
        return {k: x + self.eta * m[k] / (np.sqrt(v[k]) + self.tau) for k, x in current.items()}
