"""One rollout record: what vLLM sampled, in the layouts the trainer scores it in.

`Rollout.from_vllm(outputs, kept_sets=..., routes=...)` reads vLLM RequestOutputs (and
the optional kept-set and route captures of titan_rl.vllm.sampling / titan_rl.vllm.routes)
into typed per-request fields. Its methods give the right-padded batch and the masks the
trainer's forward and the metrics (titan_rl.metrics) use. Shapes: B requests; request i
has a prompt of P_i tokens and R_i sampled tokens; L = max_i (P_i + R_i).

Position t of a padded row is the model output at token t, which predicts token t + 1:
request i's sampled tokens are predicted at positions P_i - 1 .. P_i + R_i - 2. A multi-turn
episode's row (titan_rl.rl.episodes) also holds context tokens among them (`sampled` says
which are the engine's): the masks leave those out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass

import torch


def pad_sequences(seqs: list[list[int]], pad: int) -> torch.Tensor:
    """Token sequences -> long [len(seqs), max len], right-padded with `pad`."""
    L = max(map(len, seqs))
    out = torch.full((len(seqs), L), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def response_mask(prompt_lens: list[int], response_lens: list[int], width: int) -> torch.Tensor:
    """bool [B, width]: True at the positions whose next token is a response token
    (row i: prompt_lens[i] - 1 .. prompt_lens[i] + response_lens[i] - 2)."""
    mask = torch.zeros(len(prompt_lens), width, dtype=torch.bool)
    for i, (P, R) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, P - 1 : P - 1 + R] = True
    return mask


@dataclass
class Rollout:
    """The sampler's record of one generate() call, one entry per request, in output order."""

    request_ids: list[str]  # vLLM's request ids
    prompts: list[list[int]]  # P_i prompt token ids
    tokens: list[list[int]]  # R_i sampled token ids
    mu: list[torch.Tensor]  # float64 [R_i]: the sampler's log-prob of each sampled token (vLLM's floats, exact)
    full: list[torch.Tensor | None]  # float32 [R_i, V]: full log-prob rows where vLLM recorded them, else None
    kept: torch.Tensor | None = None  # bool [sum R_i, V]: the sampler's kept set per sampled token, in request order
    kept_bytes_each: list[int] | None = None  # each request's kept sets, encoded, in bytes
    routes: list[torch.Tensor] | None = None  # MoE: expert ids [P_i + R_i - 1, layers, k], uint8 (int16 > 256 experts)
    route_bytes_per_token: int | None = None  # one position's route record in bytes
    # sparse attention: the key positions each indexer layer selected [P_i + R_i - 1, layers, topk],
    # ascending, -1 padded (int16 while positions fit, else int32)
    indices: list[torch.Tensor] | None = None
    index_bytes_per_token: int | None = None  # one position's index record in bytes
    # episodes (titan_rl.rl.episodes): which of `tokens` the engine sampled (bool [R_i]; the
    # rest are context: bridges, environment messages, masked; mu is 0 there), and each
    # row's episode. None: every token sampled (a bare generate() record).
    sampled: list[torch.Tensor] | None = None
    episodes: list | None = None  # EpisodeInfo per row
    env_seconds: float = 0.0  # wall time the environments' calls took

    @classmethod
    def from_vllm(cls, outputs, kept_sets=None, routes=None, indices=None) -> Rollout:
        """vLLM RequestOutputs (first completion each) -> Rollout. `kept_sets`: the
        KeptSets of capture_kept_sets (checked against the sampled tokens); `routes`: the
        RouteRecord of capture_routes, prefix-cache positions filled (RouteRecord.assemble);
        `indices`: the record of capture_indices (titan_rl.vllm.indices), filled the same way."""
        ids, prompts, tokens, mu, full = [], [], [], [], []
        for out in outputs:
            c = out.outputs[0]
            toks = list(c.token_ids)
            ids.append(out.request_id)
            prompts.append(list(out.prompt_token_ids))
            tokens.append(toks)
            mu.append(torch.tensor([lp[t].logprob for t, lp in zip(toks, c.logprobs)], dtype=torch.float64))
            recorded = c.logprobs and len(c.logprobs[0]) > 1  # logprobs=-1: every token of the vocabulary
            full.append(torch.stack([torch.tensor([d[t].logprob for t in range(len(d))]) for d in c.logprobs])
                        if recorded else None)
        r = cls(ids, prompts, tokens, mu, full)
        if kept_sets is not None:
            r.kept = torch.cat([kept_sets.kept_for(rid, toks) for rid, toks in zip(ids, tokens)])
            r.kept_bytes_each = [kept_sets.bytes_of(rid) for rid in ids]
        if routes is not None:
            by_id = routes.assemble(outputs)
            r.routes = [by_id[rid] for rid in ids]
            r.route_bytes_per_token = routes.bytes_per_token
        if indices is not None:
            by_id = indices.assemble(outputs)
            r.indices = [by_id[rid] for rid in ids]
            r.index_bytes_per_token = indices.bytes_per_token
        return r

    @classmethod
    def join(cls, parts: list[Rollout]) -> Rollout:
        """The rollouts `parts` as one, requests in order (the engines' pieces of one step)."""
        parts = [p for p in parts if len(p)] or parts[:1]

        def joined(name):
            values = [getattr(p, name) for p in parts]
            if isinstance(values[0], list):
                return [x for v in values for x in v]
            if isinstance(values[0], torch.Tensor):
                return torch.cat(values)
            if name == "env_seconds":  # the engines' pieces ran concurrently: the slowest
                return max(values)
            return values[0]  # a record's size per token: one engine build, one size

        return cls(**{f.name: joined(f.name) for f in dataclasses.fields(cls)})

    def rows(self, start: int, stop: int) -> Rollout:
        """Requests start .. stop - 1 as a rollout of their own (one rank's share)."""
        # `kept` has a row per sampled token
        counts = map(len, self.tokens) if self.sampled is None else (int(m.sum()) for m in self.sampled)
        at = [0, *itertools.accumulate(counts)]

        def part(value):
            if isinstance(value, list):
                return value[start:stop]
            if isinstance(value, torch.Tensor):
                return value[at[start]:at[stop]]
            return value

        return Rollout(**{f.name: part(getattr(self, f.name)) for f in dataclasses.fields(self)})

    @property
    def kept_bytes(self) -> int | None:
        """The kept sets' encoded size in bytes."""
        return None if self.kept_bytes_each is None else sum(self.kept_bytes_each)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """The sampled tokens (sum R_i where every token is sampled)."""
        if self.sampled is not None:
            return int(sum(int(s.sum()) for s in self.sampled))
        return sum(map(len, self.tokens))

    def sequences(self, rows: range | None = None) -> list[list[int]]:
        """prompt + sampled tokens of each request in `rows` (default: all)."""
        rows = range(len(self)) if rows is None else rows
        return [self.prompts[i] + self.tokens[i] for i in rows]

    def response_span(self, i: int) -> slice:
        """The positions of request i's row that predict its sampled tokens."""
        P = len(self.prompts[i])
        return slice(P - 1, P - 1 + len(self.tokens[i]))

    def batch(self, pad: int, rows: range | None = None) -> torch.Tensor:
        """long [B, L]: the sequences of `rows` (default: all), right-padded with `pad`."""
        return pad_sequences(self.sequences(rows), pad)

    def mask(self) -> torch.Tensor:
        """bool [B, L - 1]: True at the positions that predict a sampled token (not context)."""
        L = max(map(len, self.sequences()))
        mask = response_mask([len(p) for p in self.prompts], [len(t) for t in self.tokens], L - 1)
        if self.sampled is not None:  # context tokens inside a row predict nothing the sampler drew
            for i, s in enumerate(self.sampled):
                mask[i, self.response_span(i)] &= s
        return mask

    def padded_mu(self) -> torch.Tensor:
        """float32 [B, L - 1]: mu at the mask's positions, 0 elsewhere."""
        mask = self.mask()
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for i, m in enumerate(self.mu):
            out[i, self.response_span(i)] = m.to(torch.float32)
        return out

    def digests(self, rewards: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 32]: per request, the sha256 of its prompt, sampled tokens, mu (float64
        bits) and reward (`rewards` [B], their bits). Digests are per request so that the
        data-parallel shares of a global batch, concatenated in rank order, give the
        world-of-one batch's digests whatever the layout."""
        rows = []
        for i in range(len(self)):
            h = hashlib.sha256()
            parts = (torch.tensor(self.prompts[i], dtype=torch.int64), torch.tensor(self.tokens[i], dtype=torch.int64),
                     self.mu[i].to(torch.float64), rewards[i : i + 1])
            for part in parts:
                data = part.contiguous().numpy().tobytes()
                h.update(len(data).to_bytes(8, "little") + data)
            rows.append(torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8))
        return torch.stack(rows) if rows else torch.zeros(0, 32, dtype=torch.uint8)

    def padded_routes(self) -> torch.Tensor:
        """int16 [B, L, layers, k]: the engine's experts per position, -1 where it computed
        none (padding, each row's last token). Needs `routes`."""
        if self.routes is None:
            raise ValueError("this rollout has no routes (capture_routes was not active)")
        L = max(map(len, self.sequences()))
        out = torch.full((len(self), L, *self.routes[0].shape[1:]), -1, dtype=torch.int16)
        for i, r in enumerate(self.routes):
            out[i, : r.shape[0]] = r.to(torch.int16)
        return out


    def padded_indices(self) -> torch.Tensor:
        """[B, L, layers, topk] (the record's integer dtype): the engine's selected positions
        per position, -1 where it computed none (padding, each row's last token). Needs `indices`."""
        if self.indices is None:
            raise ValueError("this rollout has no index record (capture_indices was not active)")
        L = max(map(len, self.sequences()))
        first = self.indices[0]
        out = torch.full((len(self), L, *first.shape[1:]), -1, dtype=first.dtype)
        for i, r in enumerate(self.indices):
            out[i, : r.shape[0]] = r
        return out


def _widen(t: torch.Tensor, width: int, fill) -> torch.Tensor:
    """t [B, w, ...] right-padded with `fill` to [B, width, ...]."""
    out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype)
    out[:, :t.shape[1]] = t
    return out


@dataclass
class ScoredBatch:
    """A rollout as the trainer scores it: `tokens` [B, L] (L >= the longest row: a batch
    plan may widen it), `mask` / `mu` [B, L - 1] at the positions predicting sampled
    tokens, the engine's `routes` [B, L, layers, k] (-1: none) and each row's first kept-set
    row (`kept_at`, B + 1 offsets into `kept`). `ref`, `weights`, `loss_mask`: what the
    loss takes as the old log-probs, its per-token weights and mask (mu, None and `mask`
    unless a correction sets them)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    mu: torch.Tensor
    routes: torch.Tensor | None
    kept: torch.Tensor | None
    kept_at: list[int]
    ref: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None

    @classmethod
    def of(cls, rollout: Rollout, tokens: torch.Tensor) -> ScoredBatch:
        """`tokens`: rollout.batch(pad), possibly right-padded wider."""
        L = tokens.shape[1]
        mask, mu = _widen(rollout.mask(), L - 1, False), _widen(rollout.padded_mu(), L - 1, 0.0)
        routes = None if rollout.routes is None else _widen(rollout.padded_routes(), L, -1)
        kept_at = [0, *mask.sum(1).cumsum(0).tolist()]
        indices = None if rollout.indices is None else _widen(rollout.padded_indices(), L, -1)
        return cls(tokens, mask, mu, routes, rollout.kept, kept_at, ref=mu, loss_mask=mask, indices=indices)

    def kept_rows(self, rows: range) -> torch.Tensor | None:
        return None if self.kept is None else self.kept[self.kept_at[rows.start]:self.kept_at[rows.stop]]

    def flat(self, field: str, rows: range) -> list[torch.Tensor]:
        """The engine's recorded choices `field` ("routes", "indices": titan_rl.choices) of
        `rows`, per layer [len(rows) * L, ...] (the model's replay override)."""
        r = getattr(self, field)[rows.start:rows.stop]
        flat = r.reshape(len(rows) * r.shape[1], *r.shape[2:])
        return [flat[:, layer] for layer in range(flat.shape[1])]
