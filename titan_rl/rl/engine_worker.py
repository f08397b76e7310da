"""What a trainer asks of an engine in its own process (vLLM's worker extension: these
methods are mixed into every worker and reached with `LLM.collective_rpc`).

The engine proves itself from inside: after a weight update it compares the sha256 of each
weight its forward multiplies by with the digests the trainer sent, and it describes its own
execution contract (its model object, this process's platform, versions and sources), so
the trainer's check compares two processes' own accounts, not one process with itself.
"""

from __future__ import annotations

import os

import torch


class TitanWorkerExtension:
    def _titan_model(self):
        return self.model_runner.model

    def titan_tp_layout(self) -> dict:
        """This worker's TP rank and degree, and the weights it holds a slice of {name: dim}."""
        m = self._titan_model()
        return {"rank": m._tp_rank, "tp": m._tp, "split": dict(m._tp_split)}

    def titan_verify_weights(self, expected_by_rank: list[dict[str, str]]) -> list[str]:
        """The names whose digest differs from what this TP rank should hold
        (`expected_by_rank[rank]`), or that one side lacks, sorted."""
        m = self._titan_model()
        expected = expected_by_rank[m._tp_rank]
        theirs = m.weight_digests()
        return sorted(n for n in expected.keys() | theirs.keys() if expected.get(n) != theirs.get(n))

    def titan_contract(self) -> dict:
        """This engine's execution contract (its entries) and where it runs."""
        from titan_rl import contract

        c = contract.model_contract(self._titan_model(), self.model_runner.model_config)
        return {"entries": c.entries(), "pid": os.getpid(), "threads": torch.get_num_threads()}
