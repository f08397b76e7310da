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
        """This worker's TP rank and degree, and the weights it holds a slice of {name: dim}
        (vLLM's own model, kernels = 'stock': its rank and degree; its slices are not ours to name)."""
        m = self._titan_model()
        if not hasattr(m, "_tp_split"):
            tp = self.model_runner.parallel_config.tensor_parallel_size
            return {"rank": self.rank % tp, "tp": tp, "split": {}}
        return {"rank": m._tp_rank, "tp": m._tp, "split": dict(m._tp_split)}

    def titan_verify_weights(self, expected_by_rank: list[dict[str, str]]) -> dict:
        """This TP rank's weights against what it should hold (`expected_by_rank[rank]`):
        {"differ": names whose digest differs or that one side lacks, sorted; "sha256": the
        combined digest of what it holds, "rank": its TP rank}."""
        from titan_rl.weight_digests import combined_digest, digest_differences

        m = self._titan_model()
        held = m.weight_digests()
        return {"differ": digest_differences(expected_by_rank[m._tp_rank], held), "sha256": combined_digest(held),
                "rank": m._tp_rank}

    def titan_contract(self) -> dict:
        """This engine's execution contract (its entries) and where it runs."""
        from titan_rl.vllm.engine_contract import model_contract

        c = model_contract(self._titan_model(), self.model_runner.model_config)
        return {"entries": c.entries(), "pid": os.getpid(), "threads": torch.get_num_threads()}

    def titan_capture_begin(self, names: list[str]) -> None:
        """Open the captures `names` (titan_rl.choices.KINDS: kept sets, routes, key indices) on
        this worker's model runner for the next generate: the engine's choices are recorded
        in the process that makes them, as an in-process engine's are."""
        import contextlib

        from titan_rl.choices import KINDS

        if getattr(self, "_titan_capture", None) is not None:
            raise RuntimeError("titan_capture_begin: the previous capture was not ended")
        with contextlib.ExitStack() as stack:
            records = {n: stack.enter_context(KINDS[n].open_capture(self.model_runner)) for n in names}
            self._titan_capture = (stack.pop_all(), records)

    def titan_capture_end(self) -> bytes:
        """Close the open captures (closing is where they refuse steps they could not
        attribute) and return their records {kind: record}, pickled: vLLM's RPC carries bytes."""
        import pickle

        stack, records = self._titan_capture
        self._titan_capture = None
        stack.close()
        return pickle.dumps(records)

    def titan_corrupt_operand(self, name: str) -> None:
        """Tests only: change one element of the prepared operand `name` in this engine
        process (`corrupt_operand`), to see the post-sync check name it."""
        m = self._titan_model()
        corrupt_operand(m._net, name, m._lm_head_prepared)


def corrupt_operand(net, name: str, lm_head=None, field: str | None = None) -> None:
    """Change one element of the prepared operand a weight_digests name `name` names
    (models.layers.held_operands of the engine's model `net`; LM_HEAD_OPERAND: `lm_head`, the
    wrapper's), where the engine's forward reads it: the first element of its first tensor, or
    of its tensor `field` (a PackedWeight's "few_rows" copy, a PackedQuant's payload or scales;
    without `field`, a PackedWeight's few-rows copy of that element too, so either path moves,
    and the PackedQuant field the forward reads on this CPU: its expanded blocks on AVX2) (a float x becomes x + max|t|, a code byte flips
    an exponent bit of each value in it). For the tests of the post-sync check
    (titan_rl/rl/engine_link.py)."""
    from titan_rl.models.layers import LM_HEAD_OPERAND, held_operands

    held = {**dict(held_operands(net)), LM_HEAD_OPERAND: lm_head}
    base = next((n for n in held if name == n or name.startswith(n + ".")), None)
    if base is None:
        raise KeyError(f"no prepared operand {name!r} in this engine")
    op = held[base]
    for key in name[len(base) + 1:].split(".") if name != base else []:  # into a dict / list of operands (GLM-5's absorbed per-head weights)
        op = op[key] if isinstance(op, dict) else op[int(key)]
    if isinstance(op, torch.Tensor):
        _bump(op)
        return
    if field is None and isinstance(getattr(op, "few_rows", None), torch.Tensor):
        _bump(op.few_rows)  # the same element's copy that decode at 1-4 rows reads (PackedWeight)
    if field is None and hasattr(op, "read_fields"):  # a PackedQuant: what the forward reads on this CPU
        field = op.read_fields()[0]
    field = field or next(f for f in type(op).__slots__ if isinstance(getattr(op, f), torch.Tensor))
    t = getattr(op, field)
    if t.layout == torch._mkldnn:  # oneDNN's blocked layout: edit the plain form, reorder it back
        plain = t.to_dense()
        _bump(plain)
        setattr(op, field, torch.ops.mkldnn._reorder_linear_weight(plain, None))
    else:
        _bump(t)


@torch.no_grad()
def _bump(t: torch.Tensor) -> None:
    if t.dtype == torch.int16:  # AVX2's expanded blocks: bf16 bits (a byte flip of a 0 gave a
        t = t.view(torch.bfloat16)  # subnormal, which the kernel's DAZ reads as 0: a flaky test)
    if t.is_floating_point() and t.element_size() > 1:
        # x -> x + max|t|: a change as large as the tensor's largest value, whatever x is (2x + 1
        # turned an expanded block's 0 into 1, which its column scale of ~1e-4 made too small to move
        # a bf16 output)
        flat = t.view(-1)
        big = float(flat.abs().max())
        flat[0] = flat[0] + (big if 0.0 < big < float("inf") else 1.0)
    else:  # fp8 / packed fp4 codes: bit 6 and bit 2 (e4m3's top exponent bit; each e2m1 nibble's)
        t.view(torch.uint8).view(-1)[0] ^= 0x44
