"""Rollout engines as their own processes (`rollout.placement = "separate"`).

Trainer rank 0 starts `rollout.engines` vLLM engines, each in its own process (vLLM's
engine-core process; at `rollout.engine_tp` = 2 its two worker processes), all with our
plugin and the same kernels; they die with it (titan_rl.vllm.plugin). Every rank's share of
the step's requests is gathered on rank 0, cut into one contiguous piece per engine,
generated concurrently, and each rank gets its share's Rollout back. Sampling is seeded per
request from (seed, step, global index) and the kernels are batch-invariant, so the rollout
is the one the config alone defines, whatever the number of engines or ranks.

Weights go over vLLM's weight-transfer mechanism (the "gloo" backend,
titan_rl.vllm.weight_transfer) with a version, the training step they come from. After each
transfer the engine checks, in its process, the sha256 of every weight its forward
multiplies by against the digests the trainer sent, and describes its own execution
contract, which the trainer checks against its own: two processes' accounts. With
model.kernels = 'stock' the engine runs vLLM's own model (the stock column of a separate
run), whose weights are checked as an in-process stock engine's are: not at all (its fused
parameters have other names); its contract is, and differs from the trainer's by design.

With `rollout.max_off_policy_steps = K` >= 1 the link submits the rollouts of the next K
steps before the trainer trains on this one (`submit` returns at once, generation runs in a
thread while the engine processes compute); a weight transfer first waits for the rollouts
started before it, so each rollout's version is the one it was started under.

Faults: an engine process that dies is seen within about a second (vLLM's client watches
its processes); the run stops naming the engine, or with `rollout.restart_engines` starts a
new one, sends it the current weights and regenerates that engine's piece (the same
requests and seeds give the same tokens).
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_rl import contract
from titan_rl.errors import RunStopped
from titan_rl.weight_digests import WeightCheck, combined_digest
from titan_rl.launch import free_port
from titan_rl.rl.engine_link import EngineLink, Ticket, trainer_state
from titan_rl.rl.episodes import parts_per_episode
from titan_rl.rollout import Rollout
from titan_rl.run_dir import engine_folder


@dataclass
class _Engine:
    index: int
    llm: object
    sender: object  # GlooTrainerWeightTransferEngine
    pids: list[int]  # its processes: the engine core, then the workers
    layout: dict  # its TP layout (rank 0's: degree and the weights split along which dim)


class SeparateEngines(EngineLink):
    def __init__(self, cfg, run_dir: str, model: torch.nn.Module, compute_dtype: torch.dtype, ranks,
                 gradient_reduction: str, env=None):
        super().__init__(cfg, model, compute_dtype, ranks, gradient_reduction, env)
        self.run_dir = run_dir
        self.engines: list[_Engine] = []
        self.version: int | None = None  # the training step whose weights the engines hold
        self.started: list[Ticket] = []
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan_rl-rollout") \
            if ranks.rank == 0 else None
        self.restarts = 0
        self.sync_bytes = 0
        self._last_sent = None  # rank 0, restart_engines: (state sent, its digests, step) of the last transfer
        self._held: dict[int, str] = {}  # rank 0: each engine's combined digest after its last verified sync

    # -- the engines (rank 0) --------------------------------------------------------------
    def _launch(self, index: int, folder: str) -> _Engine:
        from titan_rl.vllm.engine import EngineSettings, make_llm
        from titan_rl.vllm.weight_transfer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, LLMClient

        r, a = self.cfg.rollout, self.cfg.algorithm
        per_engine = -(-a.prompts_per_step * a.group_size // r.engines)
        before = _children()
        llm = make_llm(folder, EngineSettings.for_rollouts(self.cfg, per_engine, tensor_parallel_size=r.engine_tp,
                                                           own_process=True))
        sender = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(rank=0, port=free_port(), engine_workers=r.engine_tp), client=LLMClient(llm))
        # its processes: the engine core this process started, and the workers it started
        pids = sorted(_children() - before) + [d["pid"] for d in llm.collective_rpc("titan_contract")]
        return _Engine(index, llm, sender, pids, llm.collective_rpc("titan_tp_layout")[0])

    def _start(self, step: int) -> None:
        from titan_rl.checkpoint import save_hf_folder
        from titan_rl.dtypes import DTYPES

        state = trainer_state(self.model, self.cfg.model.dtype)  # every rank: full tensors are a collective
        self.version = step - 1
        if self.ranks.rank == 0:
            folder = engine_folder(self.run_dir, 0)
            save_hf_folder(self.model, folder, dtype=DTYPES[self.cfg.model.dtype], arch=self.cfg.model.name,
                           state_dict=state)
            self.engines = [self._launch(i, folder) for i in range(self.cfg.rollout.engines)]
        self._check_engines("before the first rollout")

    def _check_engines(self, when: str) -> None:
        """Every engine's own contract (from its process, sent to every rank) against each
        rank's trainer: every rank checks, so every rank logs the same contract."""
        seen = self.ranks.broadcast([[d["entries"] for d in e.llm.collective_rpc("titan_contract")]
                                     for e in self.engines] if self.ranks.rank == 0 else None)
        for i, workers in enumerate(seen):
            for entries in workers:
                self._check_contract_against(contract.Contract.from_entries(entries), f"{when} (engine {i})")

    def _check_engine(self, e: _Engine, when: str) -> None:
        """Engine e's own contract against the trainer's (rank 0: a restarted engine)."""
        for d in e.llm.collective_rpc("titan_contract"):
            self._check_contract_against(contract.Contract.from_entries(d["entries"]), f"{when} (engine {e.index})")

    def _agree(self, error: Exception | None) -> None:
        """Every rank raises when rank 0 found `error` (the ranks take the decision together)."""
        if self.ranks.any(error is not None):
            raise error or RunStopped("the rollout engines (on rank 0) refused; rank 0 names why")

    def _dead(self, e: _Engine) -> bool:
        dead = getattr(e.llm.llm_engine.engine_core.resources, "engine_dead", False)
        return bool(dead) or not all(_alive(p) for p in e.pids)

    # -- sampling --------------------------------------------------------------------------
    def submit(self, step, episodes, capture=()):
        """Gather the ranks' episodes for `step` on rank 0 and start running them with the
        engines' current weights (returns at once; the environments answer on rank 0); the
        captures are opened in the engines' worker processes and their records come back
        with the outputs."""
        if not self.engines and self.version is None:
            self._start(step)
        shares = [None] * self.ranks.world if self.ranks.rank == 0 else None
        mine = (self.ranks.dp_rank, episodes)
        if self.ranks.world > 1:
            dist.gather_object(mine, shares, dst=0)
        else:
            shares = [mine]
        future = None
        if self.ranks.rank == 0:
            by_dp: dict[int, list] = {}
            for dp, eps in shares:
                by_dp.setdefault(dp, eps)
            ordered = [by_dp[d] for d in sorted(by_dp)]
            future = self.thread.submit(self._generate, step, ordered, tuple(capture), self.version)
        p = Ticket(self.version, tuple(capture), future=future, step=step)
        self.started.append(p)
        return p

    def collect(self, p):
        """(this rank's Rollout, seconds rank 0 spent generating, the weights' version)."""
        payload, error = None, None
        if self.ranks.rank == 0:
            try:
                shares, dt = p.future.result()
            except RunStopped as e:
                error = e
            else:
                payload = [(share, dt) for share in shares]
        self._agree(error)
        self.started.remove(p)
        if self.ranks.world > 1:
            box, dp_of = [None], self._dp_ranks()  # a collective: every rank
            if self.ranks.rank == 0:
                per_rank = [payload[dp] for dp in dp_of]
                dist.scatter_object_list(box, per_rank, src=0)
            else:
                dist.scatter_object_list(box, None, src=0)
            rollout, dt = box[0]
        else:
            rollout, dt = payload[0]
        return rollout, dt, p.version

    def _dp_ranks(self) -> list[int]:
        """Each global rank's data-parallel rank (gathered once)."""
        if not hasattr(self, "_dp_of_rank"):
            every = [None] * self.ranks.world
            dist.all_gather_object(every, self.ranks.dp_rank)
            self._dp_of_rank = every
        return self._dp_of_rank

    def _generate(self, step: int, shares: list[list], capture: tuple, version: int) -> tuple[list[Rollout], float]:
        """Rank 0's rollout thread: the shares' episodes in one global order, cut into one
        contiguous piece per engine, run concurrently (each engine's records assembled
        against its own piece: its prefix cache is its own); one Rollout per share."""
        t0 = time.perf_counter()
        flat = [ep for eps in shares for ep in eps]
        n = len(self.engines)
        size = -(-len(flat) // n)
        pieces = [flat[i * size:(i + 1) * size] for i in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(self._piece, e, piece, capture, step, version)
                       for e, piece in zip(self.engines, pieces)]
            results = [f.result() for f in futures]
        for i, got in enumerate(results):
            if got is None:  # the engine died: restarted here, in the long-lived rollout thread
                # (an engine process dies with the thread that started it), or the run stops
                self.engines[i] = self._restart(self.engines[i], f"the rollout of step {step}")
                results[i] = self._piece(self.engines[i], pieces[i], capture, step, version)
                if results[i] is None:
                    raise RunStopped(self._death(self.engines[i], f"the rollout of step {step} (after a restart)"))
        whole = Rollout.join(results)
        dt = time.perf_counter() - t0
        grouped, at = [], 0
        rows_each = parts_per_episode(self.env)  # an episode's rows: one function of the environment
        for eps in shares:
            grouped.append(whole.rows(at, at + len(eps) * rows_each))
            at += len(eps) * rows_each
        return grouped, dt

    def _piece(self, e: _Engine, piece: list, capture: tuple, step: int, version: int) -> Rollout | None:
        """Engine e's Rollout of the episodes `piece`, with the records of `capture` made in
        its worker (TP: the first worker's; each computes every token's choices); None when
        its process died (a rerun replays the same episodes: their environments start anew
        from the same starts)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if not piece:
            return Rollout.from_vllm([])
        if self._dead(e):
            return None
        done = threading.Event()

        def watch():
            # vLLM's offline client marks a dead engine core but leaves a waiting generate
            # blocked on its output queue: wake it with the error it would have raised
            while not done.wait(0.5):
                if self._dead(e):
                    e.llm.llm_engine.engine_core.outputs_queue.put(EngineDeadError())
                    return

        threading.Thread(target=watch, name=f"titan_rl-engine{e.index}-watch", daemon=True).start()
        try:
            # each turn's version: what the engine holds when it samples (a sync waits for the
            # rollouts started before it, so an episode runs on one version: mixed_version_tokens 0)
            run = self.episode_run(piece, step, version, version_of=lambda: self.version)
            if capture:
                e.llm.collective_rpc("titan_capture_begin", args=(list(capture),))
            run.run(lambda prompts, params: e.llm.generate(prompts, params, use_tqdm=False))
            records = pickle.loads(e.llm.collective_rpc("titan_capture_end")[0]) if capture else {}
            return run.rollout(**records)
        except EngineDeadError:
            return None
        finally:
            done.set()

    def _death(self, e: _Engine, during: str) -> str:
        last = self._last_checkpoint()
        where = f"the last checkpoint (step {last})" if last else "the start (no checkpoint was written)"
        restart = "" if self.cfg.rollout.restart_engines else "; rollout.restart_engines = true restarts it instead"
        return (f"rollout engine {e.index} (pids {', '.join(map(str, e.pids))}) died during {during}: the run "
                f"stops; a relaunch resumes from {where}{restart}")

    def _last_checkpoint(self) -> int:
        from titan_rl.run_dir import latest_checkpoint_step

        return latest_checkpoint_step(self.cfg, self.run_dir) if self.cfg.checkpoint.enable else 0

    # -- weights ---------------------------------------------------------------------------
    def sync(self, step: int) -> WeightCheck | None:
        from titan_rl.quant_weights import quantized_state, weight_recipes

        error = None
        if self.ranks.rank == 0:
            for p in self.started:  # rollouts started before this sync are sampled with the old weights
                try:
                    p.future.exception()
                except BaseException:  # noqa: BLE001  (collect() reports it)
                    pass
        state = trainer_state(self.model, self.cfg.model.dtype)
        if self.cfg.rollout.restart_engines:
            # a copy: in the compute dtype `trainer_state` may return the parameters themselves, and
            # a restarted engine is re-sent these while the trainer steps on (self._last_sent)
            state = {n: t.clone() for n, t in state.items()}
        recipes = weight_recipes(self.model)
        self.version = step
        if self.ranks.rank == 0:
            sent = quantized_state(state, recipes)
            expected = _expected_digests(self.model, state, recipes, sent, self.engines[0].layout) \
                if self.checks_weights else None
            self._last_sent = (sent, expected, step) if self.cfg.rollout.restart_engines else None
            self.sync_bytes = 0
            try:
                for i, e in enumerate(self.engines):
                    self.engines[i] = e = self._send(e, sent, expected, step)
            except RunStopped as err:
                error = err
        self._agree(error)
        self._check_engines(f"after the weight sync of step {step}")
        if not self.checks_weights:
            return None
        check = None
        if self.ranks.rank == 0:  # the engines answer rank 0
            # each engine's digest read in its own processes; the trainer's from what it expects
            # of each engine's ranks, once per engine, so both sides combine the same way
            mine = _per_engine([combined_digest(d) for d in expected])
            held = {self._held[e.index] for e in self.engines}
            check = WeightCheck(mine, held.pop() if len(held) == 1 else combined_digest(sorted(held)))
        return self.ranks.broadcast(check)

    def _send(self, e: _Engine, sent: dict, expected: dict, step: int) -> _Engine:
        """The weights of `step` into engine e, verified there; a dead engine is restarted
        (rollout.restart_engines) or stops the run."""
        from titan_rl.quant_weights import weights_differ

        when = f"the weight sync of step {step}"
        if self._dead(e):
            return self._restart(e, when)  # it holds the weights of this sync (self._last_sent)
        self.sync_bytes += e.sender.send_state(sent, str(step))
        e.llm.reset_prefix_cache()  # KV and states computed under the old weights are never reused
        if expected is None:
            return e
        seen = sorted(e.llm.collective_rpc("titan_verify_weights", args=(expected,)), key=lambda d: d["rank"])
        bad = sorted({n for d in seen for n in d["differ"]})
        if bad:
            raise RunStopped(weights_differ(f"after {when}", f"engine {e.index}", bad, ", computed in each process"))
        self._held[e.index] = _per_engine([d["sha256"] for d in seen])
        return e

    def _restart(self, e: _Engine, during: str) -> _Engine:
        """A new engine in place of the dead e, holding the weights e held (the start
        folder, then the last transfer again), or RunStopped without restart_engines."""
        if not self.cfg.rollout.restart_engines:
            raise RunStopped(self._death(e, during))
        print(f"WARNING: rollout engine {e.index} (pids {', '.join(map(str, e.pids))}) died during {during}; "
              "restarting it (rollout.restart_engines = true)", flush=True)
        _shutdown(e)
        self.restarts += 1
        new = self._launch(e.index, engine_folder(self.run_dir, 0))
        if self._last_sent is not None:
            sent, expected, step = self._last_sent
            new = self._send(new, sent, expected, step)
        self._check_engine(new, f"after restarting engine {e.index}")
        return new

    def metrics(self) -> dict:
        m = {"weight_sync_bytes": self.sync_bytes}
        if self.restarts:
            m["engine_restarts"] = self.restarts
        return m

    def close(self) -> None:
        for e in self.engines:
            _shutdown(e)
        self.engines = []
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)


def _per_engine(rank_digests: list[str]) -> str:
    """One engine's combined digest from its TP ranks' (a TP-1 engine's is its rank's: the
    colocated engine's figure)."""
    return rank_digests[0] if len(rank_digests) == 1 else combined_digest(rank_digests)


def _expected_digests(model: torch.nn.Module, state: dict, recipes: dict, sent: dict, layout: dict
                      ) -> list[dict[str, str]]:
    """Per engine TP rank, what its weight_digests must give (titan_rl.quant_weights.trainer_digests)
    from the weights as that rank holds them: the full weight, or its slice along the dim the
    engine splits it (titan_rl.parallel.plan; a quantized weight is held whole: TP 1 only)."""
    from titan_rl.parallel.plan import local_shard
    from titan_rl.quant_weights import trainer_digests

    tp, split = layout["tp"], layout["split"]

    def local(d: dict, r: int) -> dict:
        return {n: local_shard(w, split[n], r, tp) if n in split and tp > 1 else w for n, w in d.items()}

    return [trainer_digests(model, local(state, r), recipes, local(sent, r)) for r in range(tp)]


def _children() -> set[int]:
    import psutil

    out = set()
    for p in psutil.Process().children():
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):  # multiprocessing's, not an engine
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def _shutdown(e: _Engine) -> None:
    try:
        e.llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001  (a dead engine's sockets may already be gone)
        pass
