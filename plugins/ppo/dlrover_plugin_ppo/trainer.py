"""The driver of ``ppo`` and ``grpo`` jobs.

Each iteration moves the experience between roles as ``DRef`` s, so the batch goes
worker-to-worker and the driver only sees metadata (prompt ids) and scalars
(losses, returns)::

    batch  = rollout.generate(it, prompt_ids)         # DRef, one batch per rollout rank
    scores = reward.score(batch)                      # DRef   (if a reward role)
    ref    = reference.log_probs(batch)               # DRef   (if a reference role)
    values = critic.values(batch)                     # DRef   (ppo)
    adv    = actor.compute_advantages(batch, scores, ref, values)   # DRef on the actor
    critic.update(adv); actor.update(adv)             # in parallel; scalar stats back
    rollout.set_weights(actor.get_weights())          # actor rank 0 -> every rollout rank

Auto-shard splits each ``DRef`` of ``m`` results over a consumer's ``n`` ranks in
order (``m / n`` each), which the template's checks keep exact.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import ray

from dlrover_core import BaseTrainer
from dlrover_core.master.placement import bundle_index
from dlrover_plugin_ppo.config import RLConfig

def aggregate(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine per-rank stats: lists are concatenated in rank order, numbers averaged,
    except counts named ``num_*``, which are summed."""
    out: dict[str, Any] = {}
    keys = {k for d in per_rank for k in d}
    for k in sorted(keys):
        vals = [d[k] for d in per_rank if k in d]
        if isinstance(vals[0], (list, tuple)):
            out[k] = [x for v in vals for x in v]
        elif k.startswith("num_"):
            out[k] = float(sum(vals))
        else:
            out[k] = float(sum(vals) / len(vals))
    return out


def shares_weights(actor: Any) -> bool:
    """Whether :func:`push_weights` should offer CUDA IPC handles first: actor rank 0's
    policy is on a CUDA device (``policy_device()``). Asked once per driver."""
    return str(actor.policy_device.options(target="RANK0")()).startswith("cuda")


def push_weights(actor: Any, targets: list[Any], share: bool = True) -> list[list[Any]]:
    """The weight sync from actor rank 0 to every rank of each role group in
    ``targets``. Blocks until every rank has loaded the weights; returns each target's
    per-rank ``set_weights`` results (the rollouts' weights versions).

    1. With ``share`` (the default): ``actor.share_weights()`` on rank 0 exports its
       policy as CUDA IPC handles (``None`` for a CPU policy), and every target rank's
       ``set_weights_shared`` maps them and copies GPU to GPU when it runs on the same
       GPU (collocated roles); the others answer ``None``
       (:mod:`dlrover_plugin_ppo.shared_weights`).
    2. For the ranks that answered ``None`` (all of them for a CPU policy, or with
       ``share=False``): ``actor.get_weights()`` on rank 0 (a CPU state dict, put into
       the object store once as the call's result), then those ranks' ``set_weights``,
       which fetch it from that object store (the driver only holds the reference).
    """
    results: list[list[Any]] = [[None] * t.world_size for t in targets]
    if share:
        shared = actor.share_weights.options(blocking=False, target="RANK0")()
        calls = [t.set_weights_shared.options(blocking=False)(shared) for t in targets]
        results = [c.get() for c in calls]
    missing = [(i, r) for i, per_rank in enumerate(results)
               for r, v in enumerate(per_rank) if v is None]
    if not missing:
        return results
    weights = actor.get_weights.options(blocking=False, target="RANK0")()
    whole = {i for i, t in enumerate(targets)
             if sum(1 for j, _ in missing if j == i) == t.world_size}
    calls = {i: targets[i].set_weights.options(blocking=False)(weights) for i in whole}
    single = {(i, r): targets[i].handles[r].call.remote("set_weights", weights.refs[0])
              for i, r in missing if i not in whole}
    for i, c in calls.items():
        results[i] = c.get()
    for (i, r), v in zip(single, ray.get(list(single.values()))):
        results[i][r] = v
    return results


class PPOTrainer(BaseTrainer):
    """Runs the PPO (``ppo`` template) or GRPO (``grpo``) loop over the job's roles.

    Metrics reported each iteration (``summary.json`` keeps the last): ``iteration``,
    ``mean_return`` (mean over the last ``rl.return_window`` finished episodes, when
    the rollout reports ``episode_returns``), ``episodes``, the actor's
    ``policy_loss``/``entropy``/``approx_kl``/``clip_frac``/``kl_ref``, the critic's
    ``value_loss``/``explained_variance``, the reward's ``reward_mean``, the rollout's
    numeric stats (counts ``num_x`` per iteration, with running sums ``total_x``),
    ``iteration_s`` and ``elapsed_s``; with ``rl.evaluate`` also
    ``<m>_before`` and ``<m>_after`` for each metric of the actor's ``evaluate()``.
    """

    def init(self) -> None:
        self.algorithm = str(self.config.get("rl_algorithm", "ppo"))
        self.rl = RLConfig.from_config(self.config, self.algorithm)
        roles = set(self.get_role_groups())
        if "actor" not in roles:
            raise ValueError(f"an RL job needs an 'actor' role; this one has {sorted(roles)}")
        self.has = {r: r in roles for r in ("rollout", "reference", "reward", "critic")}
        self.gen = self.RG_ROLLOUT if self.has["rollout"] else self.RG_ACTOR
        self.placement = self.record_placement()
        self.returns: collections.deque[float] = collections.deque(maxlen=self.rl.return_window)
        self.episodes = 0
        self.totals: dict[str, float] = {}
        self.start_it, self.final_before = 0, None
        self._share_weights: bool | None = None  # shares_weights(), at the first sync
        #: how far the current attempt of an iteration got (see :meth:`iteration`)
        self.progress = "calls"
        #: the in-place recoveries of this driver (:meth:`recover_in_place`)
        self.retries: list[dict] = []
        #: roles whose state is checkpointed at each commit (``has_state()`` of rank 0)
        self.stateful = [r for r in sorted(roles) if self._ask(r, "has_state", False)]
        #: roles whose failover policy is ``replace`` (asked now, while all are alive)
        self.replaceable = [r for r in sorted(roles)
                            if self._ask(r, "failover_policy", "rollback") == "replace"]
        state = self.load_state()  # a restarted driver resumes where it was
        if state is not None:
            self.start_it = state["it"] + 1
            self.returns.extend(state["returns"])
            self.episodes, self.totals = state["episodes"], state["totals"]
            self.final_before = state["final_before"]
        #: iterations done as of the last commit (the stateful roles' checkpoint step)
        self.committed = self.start_it
        if state is not None or self._context.attempt > 0:
            self.rollback(state)
        self.sync_weights(initial=state is None)

    # ------------------------------------------------------------------ commits
    def rollback(self, state: dict | None, report: bool = True) -> None:
        """A restarted driver: put every stateful role back to the last commit (the
        roles that kept running may be ahead of it: an update of the iteration that was
        lost), drop what stateless roles counted since, and report the committed
        iteration again if the master never got it (the driver died between its commit
        and its report)."""
        step = self.committed
        calls = [getattr(self, f"RG_{r.upper()}").restore_state.options(blocking=False)(step)
                 for r in self.stateful]
        for c in calls:
            c.get()
        if (self.has["rollout"] and "rollout" not in self.stateful
                and callable(getattr(self.actor_classes.get("rollout"), "restore_state", None))):
            self.RG_ROLLOUT.restore_state(step)  # drops what it generated since
        if self.has["reward"]:
            self.RG_REWARD.stats()  # scores of the lost iteration's attempt
        if report and state is not None and state.get("metrics"):
            from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

            master = ray.get_actor(master_actor_name(self._context.job),
                                   namespace=MASTER_NAMESPACE)
            if int(ray.get(master.status.remote()).get("step", -1)) < state["it"]:
                self.report(state["it"], **state["metrics"])

    def commit(self, it: int, metrics: dict[str, float], final: dict[str, float]) -> None:
        """End of iteration ``it``: every stateful role saves its state as step ``it + 1``
        (iterations done; all ranks in parallel, each waits for its saver's commit), then
        the driver's own state is written atomically: that write is the commit. A role's
        step above the driver's committed one is never loaded (a restart asks for the
        committed step by number)."""
        step = it + 1
        calls = [getattr(self, f"RG_{r.upper()}").save_state.options(blocking=False)(step)
                 for r in self.stateful]
        for c in calls:
            c.get()
        self.save_state({"it": it, "step": step, "returns": list(self.returns),
                         "episodes": self.episodes, "totals": self.totals,
                         "final_before": final, "metrics": metrics})
        self.committed = step

    # ------------------------------------------------------------------ placement
    def record_placement(self) -> dict[str, Any]:
        """Where each role instance actually runs, asked from the actors through Ray:
        ``{role: [{"rank", "node_id", "pid", "placement_group_id", "bundle"}]}`` plus
        ``driver`` (this process). Written to ``<job dir>/placement.json``."""
        out: dict[str, Any] = {}
        for role in self.get_role_groups():
            infos = ray.get([h.node_info.remote() for h in self.actor_handles[role]])
            out[role] = [{"rank": r, "node_id": i["node_id"], "pid": i["pid"],
                          "placement_group_id": i["placement_group_id"],
                          "bundle": bundle_index(i["assigned_resources"]),
                          "resources": i["assigned_resources"]}
                         for r, i in enumerate(infos)]
        ctx = ray.get_runtime_context()
        out["driver"] = {"pid": os.getpid(), "node_id": ctx.get_node_id()}
        if self.job_dir:
            os.makedirs(self.job_dir, exist_ok=True)
            with open(os.path.join(self.job_dir, "placement.json"), "w") as f:
                json.dump(out, f, indent=1)
        return out

    # ------------------------------------------------------------------ weights
    def sync_weights(self, initial: bool = False) -> None:
        """Actor rank 0's weights to every rollout rank (and, first time, to the
        reference when ``rl.sync_reference``): :func:`push_weights`, offering CUDA IPC
        handles first when the actor's policy is on a GPU (:func:`shares_weights`)."""
        need_rollout = self.has["rollout"]
        need_ref = initial and self.has["reference"] and self.rl.sync_reference
        targets = ([self.RG_ROLLOUT] if need_rollout else []) + \
            ([self.RG_REFERENCE] if need_ref else [])
        if targets:
            if self._share_weights is None:
                self._share_weights = shares_weights(self.RG_ACTOR)
            push_weights(self.RG_ACTOR, targets, share=self._share_weights)

    # ------------------------------------------------------------------ one iteration
    def prompt_ids(self, iteration: int) -> list[int] | None:
        """Prompt ids of an iteration (``rl.prompts_per_iter`` consecutive integers), or
        ``None`` when the rollout chooses its inputs."""
        p = self.rl.prompts_per_iter
        return list(range(iteration * p, (iteration + 1) * p)) if p else None

    def iteration(self, it: int) -> dict[str, float]:
        """Generate, score, reference log-probs, values, advantages, update critic and
        actor, sync weights. Returns scalar metrics. The driver's running counts
        (``returns``, ``episodes``, ``totals``) change only after every call of the
        iteration returned, so an attempt that failed part-way counts nothing.

        ``self.progress`` says how far the attempt got: ``calls`` (no update has
        returned: a stateless role's failure is retried on its replacement as it is) or
        ``updated`` (an update may have run: a retry first rolls back to the commit)."""
        t0 = time.perf_counter()
        self.progress = "calls"
        nb = {"blocking": False}
        batch = self.gen.generate_iteration.options(**nb)(it, self.prompt_ids(it))
        scores = self.RG_REWARD.score.options(**nb)(batch) if self.has["reward"] else None
        ref = None
        if self.has["reference"]:
            ref = self.RG_REFERENCE.log_probs.options(**nb)(batch)
        values = self.RG_CRITIC.values.options(**nb)(batch) if self.has["critic"] else None
        adv = self.RG_ACTOR.compute_advantages.options(**nb)(batch, scores, ref, values)
        critic_upd = self.RG_CRITIC.update.options(**nb)(adv) if self.has["critic"] else None
        actor_upd = self.RG_ACTOR.update.options(**nb)(adv)
        results, error = {}, None
        for name, call in (("actor", actor_upd), ("critic", critic_upd)):
            if call is None:
                continue
            try:
                results[name] = call.get()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others
                error = error or exc
        if results:  # an update returned: the stateful roles may be ahead of the commit
            self.progress = "updated"
        if error is not None:
            raise error
        metrics: dict[str, float] = {}
        a = aggregate(results["actor"])
        a["actor_update_s"] = a.pop("update_s", 0.0)
        metrics.update(a)
        if "critic" in results:
            c = aggregate(results["critic"])
            c["critic_update_s"] = c.pop("update_s", 0.0)
            metrics.update(c)
        self.sync_weights()
        # this iteration's stats only (kept per iteration by the generating ranks), added
        # to totals that are committed with the iteration: a redone iteration replaces
        gen_stats = aggregate(self.gen.iteration_stats(it))
        reward_stats = aggregate(self.RG_REWARD.stats()) if self.has["reward"] else {}
        returns = gen_stats.pop("episode_returns", [])
        self.returns.extend(float(r) for r in returns)
        self.episodes += len(returns)
        for k, v in gen_stats.items():
            if isinstance(v, float):
                metrics[k] = v
                if k.startswith("num_"):
                    total = f"total_{k[4:]}"
                    self.totals[total] = self.totals.get(total, 0.0) + v
        metrics.update(self.totals)
        metrics.update({k: v for k, v in reward_stats.items() if isinstance(v, float)})
        if self.returns:
            metrics["mean_return"] = sum(self.returns) / len(self.returns)
        if self.episodes:
            metrics["episodes"] = float(self.episodes)
        metrics["iteration"] = float(it)
        metrics["iteration_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ stateless failover
    def _ask(self, role: str, method: str, default: Any) -> Any:
        """``method()`` of ``role``'s rank 0, or ``default`` when its workload class has
        no such method (a role that does not subclass the RL base classes)."""
        if not callable(getattr(self.actor_classes.get(role), method, None)):
            return default
        return getattr(self, f"RG_{role.upper()}").__getattr__(method).options(
            target="RANK0", blocking=True)()

    def recover_in_place(self, exc: BaseException) -> bool:
        """After a call of the iteration failed: when ranks of ``replace`` roles
        (:attr:`replaceable`: ``roles.<role>.config.failover``) are dead,
        wait for the master's replacements, rebind to them, put each replacement at the
        last commit (its state, when it has any, and the actor's weights) and return True
        (retry the iteration: survivors answer the retried calls from what they already
        did, :meth:`RLWorkload.generate_iteration`). When an update had returned
        (``progress == "updated"``) every stateful role is first rolled back to the
        commit (the attempt is then redone, still without a driver restart). False: no
        dead rank of a replaceable role (the failure is someone else's: re-raise)."""
        dead = {r: getattr(self, f"RG_{r.upper()}").dead_ranks()
                for r in self.replaceable}
        dead = {r: ranks for r, ranks in dead.items() if ranks}
        if not dead:
            return False
        master = self.master_handle
        t0 = time.perf_counter()
        for role, ranks in dead.items():
            group = getattr(self, f"RG_{role.upper()}")
            for rank in ranks:
                group.await_replacement(master, rank)
        self.__dict__.pop("actor_handles", None)
        if self.progress == "updated":
            self.rollback(None, report=False)
        else:
            for role, ranks in dead.items():
                group = getattr(self, f"RG_{role.upper()}")
                ray.get([group.handles[r].call.remote("restore_state", self.committed)
                         for r in ranks])
        if self.has["reward"]:
            self.RG_REWARD.stats()  # scores of the failed attempt
        # a replaced reference has its frozen initial policy from its own setup()
        self.sync_weights()
        self.retries.append({"roles": {r: list(v) for r, v in dead.items()},
                             "rolled_back": self.progress == "updated",
                             "seconds": round(time.perf_counter() - t0, 3),
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(f"[ppo driver] {dead} replaced; retrying the iteration's calls "
              f"({'after a rollback to the commit' if self.progress == 'updated' else 'as they were'})"
              f" after {time.perf_counter() - t0:.2f} s", flush=True)
        return True

    def target_reached(self) -> bool:
        t = self.rl.target_return
        return (t is not None and len(self.returns) >= self.rl.return_window
                and sum(self.returns) / len(self.returns) >= t)

    def evaluate(self, suffix: str) -> dict[str, float]:
        out = self.RG_ACTOR.evaluate.options(target="RANK0", blocking=True)()
        return {f"{k}_{suffix}": float(v) for k, v in (out or {}).items()}

    # ------------------------------------------------------------------ the loop
    def attempt(self, it: int, final: dict[str, float], t_start: float,
                max_retries: int = 3) -> dict[str, float]:
        """Iteration ``it`` and its commit, retried in place (:meth:`recover_in_place`)
        when a rank of a stateless role died; then the report (after the commit: a
        redone iteration is never reported twice, and a report lost to a crash after
        the commit is sent again by :meth:`rollback`)."""
        for n in range(max_retries + 1):
            saved = (list(self.returns), self.episodes, dict(self.totals))
            try:
                metrics = self.iteration(it)
                metrics["elapsed_s"] = time.perf_counter() - t_start
                metrics["target_reached"] = float(self.target_reached())
                self.progress = "updated"
                self.commit(it, {**metrics, **final}, final)
                return metrics
            except Exception as exc:  # noqa: BLE001 - retried or re-raised
                self.returns.clear()
                self.returns.extend(saved[0])
                self.episodes, self.totals = saved[1], saved[2]
                if n == max_retries or not self.recover_in_place(exc):
                    raise
        raise AssertionError("unreachable")

    def fit(self) -> dict[str, float]:
        t_start = time.perf_counter()
        final: dict[str, float] = {}
        if self.final_before is not None:
            final.update(self.final_before)
        elif self.rl.evaluate:
            final.update(self.evaluate("before"))
        metrics: dict[str, float] = {}
        it = self.start_it - 1
        for it in range(self.start_it, self.rl.iterations):
            metrics = self.attempt(it, final, t_start)
            self.report(it, **{**metrics, **final})
            if self.target_reached():
                break
            if self.rl.max_time_s and metrics["elapsed_s"] >= self.rl.max_time_s:
                break
        if self.rl.evaluate:
            final.update(self.evaluate("after"))
        final.update(metrics)
        final["iterations"] = float(it + 1)
        final["fit_s"] = time.perf_counter() - t_start
        self.report(max(it, 0), **final)
        return final
