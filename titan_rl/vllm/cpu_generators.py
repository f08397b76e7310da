"""A seeded request whose prompt is prefilled in several chunks, on vLLM's CPU worker.

vLLM samples a token for every scheduled request at every step, and throws away the token
of a request still in its prefill; it then rewinds that request's generator by the draws
the discarded sample took (`gen.set_offset(gen.get_offset() - 4)`, gpu_model_runner's
`_bookkeeping_sync`). That is a CUDA Philox generator's operation: a CPU generator
(mt19937) has no offset, and the step raises "CPU Generator does not use offset". Chunks
come with long prompts under a token budget and with mamba cache mode "align" (the hybrids'
prefix caching prefills up to block boundaries), so a multi-turn episode of a GDN hybrid,
whose later turns are long prompts, met it at once (vLLM 0.32.0, 2026-12-07).

Here the CPU worker snapshots each seeded request's generator state before it samples and,
for a discarded sample, puts that state back: the rewind vLLM means to do, for mt19937. So
a request's draws depend on its own tokens only, not on how its prompt was cut.
"""

from __future__ import annotations

import numpy as np

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    sample_tokens, bookkeeping = CPUModelRunner.sample_tokens, CPUModelRunner._bookkeeping_sync

    def sample_tokens_cpu(self, *args, **kwargs):
        self._titan_generator_states = {i: g.get_state() for i, g in self.input_batch.generators.items()}
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            self._titan_generator_states = None

    def bookkeeping_cpu(self, *args, **kwargs):
        states = getattr(self, "_titan_generator_states", None) or {}
        gens = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
        held = {}
        for i in map(int, discarded):
            if i in gens and i in states:
                gens[i].set_state(states[i])
                held[i] = gens.pop(i)  # out of vLLM's reach while it rewinds by offset
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(held)

    CPUModelRunner.sample_tokens = sample_tokens_cpu
    CPUModelRunner._bookkeeping_sync = bookkeeping_cpu
    _INSTALLED = True
