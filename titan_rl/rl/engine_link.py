"""The trainer's link to its rollout engine: start it, sample from it, sync weights into it,
and prove after each of those that it computes what the trainer computes.

`EngineLink` is the one interface the RL step uses, whatever runs the engine:
`submit(step, episodes, capture) -> Ticket` and `collect(ticket) -> (rollout, seconds,
version)`, `sync`, `contract_metrics`, `resume`. What a ticket samples is a batch of
episodes (titan_rl.rl.episodes: one turn or many, the link's environment answering between
turns), run to their end on one engine's weights. `rollout` drives them for a
training step: with `rollout.max_off_policy_steps = K` the next K steps' rollouts are
submitted before this one is collected, and the parameter versions they may be rescored at
are kept behind the link (titan_rl.rl.versions). `ColocatedEngine` is the in-process vLLM
engine each trainer rank builds (TP 1, generation and training alternate; `submit` defers,
`collect` samples); `SeparateEngines` (titan_rl.rl.separate_engines) runs engines as their
own processes (`submit` starts generating, `collect` waits).

What a link proves, each time: the execution contracts of both sides agree
(titan_rl.contract; before the first rollout and after every sync), and after a sync the
weights the engine multiplies by have the checksum of the ones the trainer's forward uses
(quantized linears: the trainer's fake-quantized masters against the engine's dequantized
payloads, titan_rl.quant_weights). Any refusal stops every rank together.
"""

from __future__ import annotations

import abc
import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from titan_rl import contract
from titan_rl.choices import KINDS
from titan_rl.dtypes import DTYPES
from titan_rl.errors import RunStopped
from titan_rl.weight_digests import WeightCheck, combined_digest, digest_differences
from titan_rl.rl.ranks import Ranks
from titan_rl.rl.versions import Versions
from titan_rl.rollout import Rollout
from titan_rl.run_dir import engine_folder


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def trainer_state(model: torch.nn.Module, dtype: str) -> dict[str, torch.Tensor]:
    """The trainer's weights, full (unsharded: a collective under FSDP / TP) and in the
    engine's dtype."""
    return {n: _full(p).detach().to(DTYPES[dtype]).contiguous() for n, p in model.named_parameters()}


@dataclass(eq=False)  # a ticket is itself: two of one version are still two
class Ticket:
    """A rollout submitted and not yet collected."""

    version: int  # the training step whose weights sample it
    capture: tuple = ()  # the kinds of the engine's choices recorded with it (titan_rl.choices.KINDS)
    episodes: list | None = None  # colocated: run when collected (titan_rl.rl.episodes.EpisodeRequest)
    future: Future | None = None  # separate, rank 0: -> (outputs per dp share, seconds); None elsewhere
    step: int = 0  # the training step it is the rollout of


class EngineLink(abc.ABC):
    """The interface: rollouts submitted and collected, a weight sync, the contract's
    metrics; and what every link shares: the sample-ahead queue, the kept parameter
    versions and the contract check."""

    def __init__(self, cfg, model: torch.nn.Module, compute_dtype: torch.dtype, ranks: Ranks,
                 gradient_reduction: str, env=None):
        self.cfg, self.model, self.ranks = cfg, model, ranks
        self.env = env  # what answers between turns (titan_rl.tasks.env); None: one bare reply per request
        self.compute_dtype = compute_dtype
        self.gradient_reduction = gradient_reduction
        # (trainer side, engine side, entries allowed to differ) of the last contract check,
        # and the last contract hash metrics.jsonl holds (its entries are written when it changes)
        self._contract = None
        self._logged_contract = None
        self._ahead: dict[int, Ticket] = {}  # step -> its rollout, submitted ahead
        self._versions: Versions | None = None

    @abc.abstractmethod
    def submit(self, step: int, episodes: list, capture=()) -> Ticket:
        """Start (or schedule) the rollout of `episodes` (EpisodeRequests) during training step
        `step`, with the weights the engine holds now; `capture`: also record these kinds of the engine's
        choices (titan_rl.choices.KINDS: the sampler's kept sets, the MoE routes, the
        indexers' key sets), where the engine makes them."""

    @abc.abstractmethod
    def collect(self, ticket: Ticket) -> tuple[Rollout, float, int]:
        """(this rank's Rollout of `ticket`, seconds spent generating, the weights' version)."""

    @abc.abstractmethod
    def sync(self, step: int) -> WeightCheck | None:
        """The trainer's current weights into the engine; what the checksum saw on each side
        (titan_rl.weight_digests.WeightCheck: a difference stops the run here), None where the
        engine's parameters are not ours to compare (`checks_weights`)."""

    @property
    def checks_weights(self) -> bool:
        """Whether a sync compares the engine's weights with the trainer's: not for the stock
        engine, vLLM's own model, whose fused qkv / gate_up parameters have other names and
        whose preparation is vLLM's."""
        return self.cfg.model.kernels != "stock"

    def rollout(self, step: int, episodes: list, episodes_of, capture=()) -> tuple[Rollout, float, int]:
        """collect() of step `step`'s rollout (`episodes`), submitted now unless it was
        submitted ahead; first the rollouts of the next max_off_policy_steps steps are
        submitted (`episodes_of(step)` -> their EpisodeRequests), and the current parameters
        kept as version step - 1 while a rollout sampled with them may be trained on."""
        r = self.cfg.rollout
        ticket = self._ahead.pop(step, None) or self.submit(step, episodes, capture)
        self.versions.keep(step - 1)
        for ahead in range(step + 1, min(step + r.max_off_policy_steps, self.cfg.training.steps) + 1):
            if ahead not in self._ahead:
                self._ahead[ahead] = self.submit(ahead, episodes_of(ahead), capture)
        return self.collect(ticket)

    def episode_run(self, episodes: list, step: int, version: int, version_of=None):
        """The EpisodeRun of `episodes` with this link's environment and settings (every link
        runs its episodes through it, on whichever engine samples them)."""
        from titan_rl.rl.episodes import EpisodeRun

        r = self.cfg.rollout
        return EpisodeRun(self.env, episodes, max_model_len=r.max_model_len, workers=r.env_workers, version=version,
                          version_of=version_of, step=step)

    @property
    def versions(self) -> Versions:
        """The parameter versions rollouts in flight were sampled with (`versions.at(v)`)."""
        if self._versions is None:
            self._versions = Versions(self.model, self.cfg.rollout.max_off_policy_steps)
        return self._versions

    def generate(self, step: int, episodes: list) -> Rollout:
        """The episodes the engine plays at its current weights, no choices recorded (an
        evaluation, not a rollout), during training step `step`."""
        return self.collect(self.submit(step, episodes))[0]

    def metrics(self) -> dict:
        """The link's own entries of the step line (none for the colocated engine)."""
        return {}

    def close(self) -> None:
        """Stop what the link started."""

    def _check_contract_against(self, engine: contract.Contract, when: str) -> None:
        """The execution contract of the trainer's model against the engine's (each computed
        from what that side holds); ContractMismatch names the entries (this rank only)."""
        mine = contract.contract_of(self.model, dtype=self.compute_dtype, gradient_leaves=self.gradient_reduction)
        differs = contract.check(mine, engine, when=when)
        self._contract = (mine, engine, differs)

    def contract_metrics(self):
        """The step line's contract: its hash on every RL line, its entries on the first and
        whenever the hash changes; in stock mode also the engine's hash and the entries
        that differ by design."""
        mine, engine, differs = self._contract
        m: dict = {"contract": mine.hash}
        if differs:
            m.update(contract_engine=engine.hash, contract_differs=differs)
        if mine.hash != self._logged_contract:
            m["contract_entries"] = mine.entries()
            if differs:
                m["contract_engine_entries"] = engine.entries()
            self._logged_contract = mine.hash
        return m

    def resume(self, kept_lines: list[dict]) -> None:
        """A relaunch: the metrics lines kept from before it (the last contract hash logged)."""
        self._logged_contract = next((m["contract"] for m in reversed(kept_lines) if "contract" in m), None)


class ColocatedEngine(EngineLink):
    """An in-process vLLM engine per trainer rank, built on the first rollout from a weight
    folder of the trainer's model (the compute dtype its forward casts to)."""

    def __init__(self, cfg, run_dir: str, model: torch.nn.Module, compute_dtype: torch.dtype, ranks: Ranks,
                 gradient_reduction: str, env=None):
        super().__init__(cfg, model, compute_dtype, ranks, gradient_reduction, env)
        self.run_dir = run_dir
        self.llm = None
        self.sync_bytes = 0

    def metrics(self):
        return {"weight_sync_bytes": self.sync_bytes}

    def _state(self) -> dict[str, torch.Tensor]:
        return trainer_state(self.model, self.cfg.model.dtype)

    def _start(self) -> None:
        from titan_rl.checkpoint import save_hf_folder
        from titan_rl.vllm.engine import EngineSettings, make_llm

        m, a = self.cfg.model, self.cfg.algorithm
        folder = engine_folder(self.run_dir, self.ranks.rank)
        save_hf_folder(self.model, folder, dtype=DTYPES[m.dtype], arch=m.name, state_dict=self._state())
        per_rank = a.prompts_per_step // self.ranks.dp_degree * a.group_size
        self.llm = make_llm(folder, EngineSettings.for_rollouts(self.cfg, per_rank))
        self._check_contract("before the first rollout")

    def submit(self, step, episodes, capture=()):
        # sampled when collected: the weights synced after step - 1
        return Ticket(step - 1, tuple(capture), episodes, step=step)

    def collect(self, ticket):
        if self.llm is None:
            self._start()
        t0 = time.perf_counter()
        run = self.episode_run(ticket.episodes, ticket.step, ticket.version)
        with contextlib.ExitStack() as stack:
            # one capture over every turn: a later turn's prefix-cache hits find their donors in it
            records = {name: stack.enter_context(KINDS[name].open_capture(self.llm)) for name in ticket.capture}
            run.run(lambda prompts, params: self.llm.generate(prompts, params, use_tqdm=False))
        dt = time.perf_counter() - t0
        # read after the captures closed: closing is where they report unattributed steps
        return run.rollout(**records), dt, ticket.version

    def sync(self, step):
        from titan_rl.quant_weights import quantized_state, state_bytes, trainer_digests, weight_recipes, weights_differ
        from titan_rl.vllm.engine import engine_model, update_weights

        state = self._state()
        recipes = weight_recipes(self.model)
        sent = quantized_state(state, recipes)
        update_weights(self.llm, sent)
        self.sync_bytes = state_bytes(sent)
        when = f"after the weight sync of step {step}"
        self._check_contract(when)
        if not self.checks_weights:
            return None
        # Two sides: the trainer's forward operands computed afresh from its masters
        # (fake-quantized where a recipe applies) and the operands the engine should have
        # prepared from what was sent (the engine's preparation code, run here); the engine's
        # digests are read from what it holds.
        mine = trainer_digests(self.model, state, recipes, sent)
        theirs = engine_model(self.llm).weight_digests()
        differ = digest_differences(mine, theirs)
        if self.ranks.any(bool(differ)):
            raise RunStopped(weights_differ(when, "the engine", differ or ["on another rank"], ""))
        return WeightCheck(combined_digest(mine), combined_digest(theirs))

    def _check_contract(self, when: str) -> None:
        """This rank's engine against its trainer; all ranks stop together if one refuses."""
        error = None
        try:
            from titan_rl.vllm import engine_contract

            self._check_contract_against(engine_contract.engine_contract(self.llm), when)
        except contract.ContractMismatch as e:
            error = e
        if self.ranks.any(error is not None):
            raise error or contract.ContractMismatch(
                f"execution contract {when}: another rank's engine differs from its trainer (that rank names "
                "the entries)")
