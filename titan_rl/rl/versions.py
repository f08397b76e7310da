"""The parameter versions a rollout sampled ahead may still be scored at.

With `rollout.max_off_policy_steps = K` a rollout can be trained on up to K optimizer steps
after the weights that sampled it; the trainer rescores it at those weights to measure the
engine against the trainer apart from policy lag. `Versions` keeps the parameters of the
last K + 1 versions and lends one to the model for a `with` block.
"""

from __future__ import annotations

import contextlib

import torch


class Versions:
    def __init__(self, model: torch.nn.Module, k: int):
        self.model, self.k = model, k
        self._kept: dict[int, list[torch.Tensor]] = {}  # version -> its parameters

    def keep(self, version: int) -> None:
        """Keep the model's current parameters as `version`; versions older than K before it
        can no longer be trained on and are dropped. Nothing is kept when K is 0."""
        if not self.k:
            return
        if version not in self._kept:
            self._kept[version] = [p.detach().clone() for p in self.model.parameters()]
        for v in [v for v in self._kept if v < version - self.k]:
            del self._kept[v]

    @contextlib.contextmanager
    def at(self, version: int):
        """The model holds the parameters of `version` inside the block. The kept tensors trade
        contents with the parameters in place (and back on exit): FSDP2 all-gathers from its own
        flat buffer, so only what is written into the parameters' storage reaches the forward,
        and one parameter's temporary at a time is all the exchange allocates."""
        params, kept = list(self.model.parameters()), self._kept[version]
        self._exchange(params, kept)
        try:
            yield
        finally:
            self._exchange(params, kept)

    @staticmethod
    def _exchange(params: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, other in zip(params, kept):
                now = p.detach().clone()
                p.copy_(other)
                other.copy_(now)
