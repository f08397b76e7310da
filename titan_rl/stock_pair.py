"""The stock pair where vLLM's own CPU ops cannot run a folder (the real hybrids in fp32, or
at shapes its CPU GDN / MoE kernels do not take; GLM-5 at any shape: vLLM's CPU build has no
sparse-attention backend; titan_rl.vllm.stock_cpu.stock_cpu_problem): transformers' own model on
both sides. Its cached decode samples (the recurrent GDN step per token, one query row of
sparse attention per step: the sampler's pass) and records mu from its raw logits; its forward
over the whole sequence (the chunked GDN form, every row at once: the trainer's pass) gives
pi. The mismatch is the prefill/decode seam of one stock implementation, which every stack
that samples with one kernel path and trains with another carries.

For a model with an indexer (GLM-5) hooks record what transformers selected on each side:
the indexers' key positions (torch.topk: among tied scores whichever it returns) and the
routers' experts, per computed position, so index and expert disagreement are measured the
same way as for our engines. With replay_indices the forward attends to the decode's
recorded key sets (the hooks replace the indexers' output), the stock form of index replay.
"""

from __future__ import annotations

import torch

from titan_rl.rollout import Rollout


class _Selections:
    """Forward hooks on transformers' GlmMoeDsaIndexer / GlmMoeDsaTopkRouter modules: every call's
    rows appended in order (a generate call computes positions 0, 1, ... in order), each index
    row reduced to its valid positions (<= its own), ascending, -1 padded to index_topk."""

    def __init__(self, model):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaTopkRouter

        self.topk = model.config.index_topk
        self.indexers = [m for m in model.modules() if isinstance(m, GlmMoeDsaIndexer)]
        self.routers = [m for m in model.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
        self.forced: torch.Tensor | None = None
        self.reset()
        self.handles = [m.register_forward_hook(self._on_index(i)) for i, m in enumerate(self.indexers)]
        self.handles += [m.register_forward_hook(self._on_route(i)) for i, m in enumerate(self.routers)]

    def reset(self, forced: torch.Tensor | None = None) -> None:
        """Start a pass; `forced` [N, indexer layers, topk]: the key sets the indexers return
        at positions 0..N-1 instead of their own."""
        self.index_rows = [[] for _ in self.indexers]
        self.route_rows = [[] for _ in self.routers]
        self.forced = forced

    def _on_index(self, layer: int):
        def hook(_mod, _args, out):
            start = sum(r.shape[0] for r in self.index_rows[layer])
            S, width = out.shape[1], out.shape[2]
            pos = torch.arange(start, start + S)
            own = out[0].long()
            valid = own <= pos[:, None]
            big = torch.iinfo(torch.int64).max
            rows = torch.where(valid, own, big).sort(-1).values
            rows = torch.where(rows == big, -1, rows)
            rows = torch.cat([rows, rows.new_full((S, max(self.topk - width, 0)), -1)], -1)[:, : self.topk]
            self.index_rows[layer].append(rows)
            if self.forced is None:
                return None
            # the recorded set of each position it covers, padded with later (causally masked) positions
            new = out.clone()
            n = min(self.forced.shape[0] - start, S)
            for r in range(max(n, 0)):
                sel = [int(j) for j in self.forced[start + r, layer] if int(j) >= 0]
                p = start + r
                fill = [j for j in range(p + 1, p + 1 + width)][: width - len(sel)]
                new[0, r] = torch.tensor((sel + fill)[:width], dtype=out.dtype)
            return new
        return hook

    def _on_route(self, layer: int):
        def hook(_mod, _args, out):
            self.route_rows[layer].append(out[2].reshape(-1, out[2].shape[-1]).sort(-1).values.to(torch.uint8))
        return hook

    def taken(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(indices [N, indexer layers, topk], routes [N, MoE layers, k]) of the pass."""
        ind = torch.stack([torch.cat(r) for r in self.index_rows], 1) if self.indexers else None
        routes = torch.stack([torch.cat(r) for r in self.route_rows], 1) if self.routers else None
        return ind, routes

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def sample_and_rescore(folder: str, cfg, prompts: list[list[int]], seed: int, full_vocab: int,
                       replay_indices: bool = False):
    """(Rollout, the trainer side's pi / entropy / full rows) of transformers' model in
    `folder` at cfg.model.dtype, with cfg.sampling's temperature / top-k / top-p: one request
    at a time, seeded per request. A sparse-attention model (GLM-5) also gives both sides'
    key sets and experts (Rollout.indices / routes, the trainer side's "indices" / "routes")."""
    from transformers import AutoModelForCausalLM

    from titan_rl.dtypes import DTYPES

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[cfg.model.dtype], local_files_only=True).eval()
    hooks = _Selections(model) if getattr(model.config, "model_type", "") == "glm_moe_dsa" else None
    s = cfg.sampling
    ro = Rollout([], [], [], [], [])
    scores = {"pi": [], "entropy": [], "full": []}
    if hooks is not None:
        ro.indices, ro.routes, scores["indices"], scores["routes"] = [], [], [], []
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                torch.manual_seed(seed * 100_003 + i)
                prompt = torch.tensor([p])
                if hooks is not None:
                    hooks.reset()
                out = model.generate(prompt, do_sample=True, temperature=s.temperature, top_k=s.top_k or None,
                                     top_p=s.top_p, max_new_tokens=s.max_tokens, min_new_tokens=s.max_tokens,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                     eos_token_id=None)
                toks = out.sequences[0, len(p):]
                n = out.sequences.shape[1] - 1  # the positions both passes compute outputs at
                if hooks is not None:
                    sampled_ind, sampled_routes = hooks.taken()
                    ro.indices.append(sampled_ind[:n])
                    ro.routes.append(sampled_routes[:n])
                    hooks.reset(forced=sampled_ind[:n] if replay_indices else None)
                mu_rows = torch.stack([lg[0].float().log_softmax(-1) for lg in out.logits])
                pi_rows = model(input_ids=out.sequences).logits[0, len(p) - 1:-1].float().log_softmax(-1)
                if hooks is not None:
                    own_ind, own_routes = hooks.taken()
                    scores["indices"].append(own_ind[:n])
                    scores["routes"].append(own_routes[:n])
                ro.request_ids.append(str(i))
                ro.prompts.append(list(p))
                ro.tokens.append(toks.tolist())
                ro.mu.append(mu_rows.gather(-1, toks[:, None])[:, 0].double())
                ro.full.append(mu_rows if i < full_vocab else None)
                scores["pi"].append(pi_rows.gather(-1, toks[:, None])[:, 0])
                scores["entropy"].append(-(pi_rows.exp() * pi_rows).nansum(-1))
                scores["full"].append(pi_rows if i < full_vocab else None)
    finally:
        if hooks is not None:
            hooks.remove()
    if hooks is not None:
        ro.index_bytes_per_token = len(hooks.indexers) * hooks.topk * 2  # int16, as our engine's record
        ro.route_bytes_per_token = len(hooks.routers) * model.config.num_experts_per_tok
    return ro, scores
