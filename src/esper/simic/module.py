"""``PPOModule``: the LightningModule that trains the growth policy.

One ``training_step`` = one rollout (an episode in every env) and one PPO update, so one
Lightning epoch is one update and ``trainer.max_epochs`` counts updates. The host data
reaches the envs through the data module's own host loaders, never through Lightning's
batch loop (whose loader yields a single tick per epoch). Optimisation is manual:
PPO makes many optimiser steps per rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule

from esper.callbacks.checkpoint import newest_checkpoint
from esper.callbacks.freed_memory import KeepFreedMemory
from esper.callbacks.gc_freeze import FreezeStartupObjects
from esper.contracts.rollout import RolloutSummary, StepBatch
from esper.kasmina import LifecycleConfig, OptimConfig
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig
from esper.mdp.rewards import RewardConfig
from esper.mdp.step_read import read_packed
from esper.simic.buffer import RolloutBuffer
from esper.simic.checkpoint_contents import (
    DATA_KEY,
    ENVS_PER_RANK_KEY,
    RUN_STATE_KEY,
    SPEC_KEY,
    check_same_action_space,
    checkpoint_policy_spec,
    data_entry,
    plain,
    policy_spec,
)
from esper.simic.hooks import RolloutHooks, governor_among
from esper.simic.learner import LearnerCopy, check_learner_run, parse_learner_device
from esper.simic.normalizer import NormalizerConfig, RunningObsNormalizer
from esper.simic.ppo import PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_collector import PPOCollector
from esper.simic.ppo_graph import RecordedMinibatches
from esper.simic.rng import capture_rng_state, restore_rng_state
from esper.simic.schedules import entropy_coef_at, learning_rate_at
from esper.simic.update_metrics import PROGRESS_BAR_METRICS, rollout_metrics
from esper.simic.validation import as_config, check_ent_coef_final, check_precision, validate_run
from esper.tamiyo.policy import PolicyConfig, PolicyNetwork
from esper.threads import intra_op_threads
from esper.tolaria.data.base import HostDataModule
from esper.tolaria.step_graph import own_recorder

#: Host arguments a run takes when it is given none: the hosts start small, so growth has
#: something to add (measured: benchmarks/README.md, "Design figures kept out of
#: docstrings").
DEFAULT_HOST_KWARGS: dict[str, dict[str, Any]] = {"cnn": {"channels": [2, 4, 8]}}

#: Offset between ranks' random seeds (and data shuffling seeds) under DDP.
RANK_SEED_STRIDE = 1_000_003


class RunFailure(RuntimeError):
    """A PPO update could not finish; the message says why and where the last checkpoint is."""


class PPOModule(LightningModule):
    """Trains a :class:`PolicyNetwork` with PPO over ``n_envs`` growing hosts.

    Args:
        n_envs: hosts trained in parallel, over all ranks (under DDP each rank trains
            ``n_envs / world size`` of them).
        episode_epochs: host epochs per episode (one rollout).
        host: registered host name (``cnn``, ``transformer`` or a plugin).
        host_kwargs: extra constructor arguments for the host; None takes
            :data:`DEFAULT_HOST_KWARGS` for that host (a small CNN that growth can add to).
        blueprints: the blueprints the policy may plant; default the host's own list (the
            ``widen`` on ``cnn``), else every registered one that fits a slot.
        widen_init: how a widening seed's new units start: ``random`` (a germination's
            draw) or ``gradient`` (the candidates the loss most needs; kasmina/widen_init.py).
        reward: registered reward family (``shaped``, ``sparse`` or a plugin).
        lifecycle: how long each seed stage lasts and what a seed must show to be kept
            (LifecycleConfig); null takes its defaults, `--model.lifecycle.help` lists them.
        host_optim: SGD settings and learning-rate schedule of the hosts and their seeds
            (OptimConfig); null takes its defaults, `--model.host_optim.help` lists them.
        rewards: weights of the reward terms and the seed parameter budget
            (RewardConfig); null takes its defaults, `--model.rewards.help` lists them.
        policy: size and initialisation of the policy network (PolicyConfig); null takes
            its defaults, `--model.policy.help` lists them.
        ppo: PPO hyper-parameters (PPOConfig); null takes its defaults,
            `--model.ppo.help` lists them.
        normalizer: how observations are standardised (NormalizerConfig); null takes its
            defaults, `--model.normalizer.help` lists them.
        ent_coef_final: entropy coefficient reached linearly by the last update;
            None keeps ``ppo.ent_coef`` throughout.
        on_oom: an env out of device memory: ``raise`` ends the run after the last
            checkpoint; ``skip_env_epoch`` lets that env sit out the epoch.
        compile: ``torch.compile`` the hosts' train step and the policy's act.
        amp: mixed precision for host training: ``off`` (default), ``bf16`` or ``fp16``.
        devices: place this rank's hosts round-robin over these devices (one process,
            several GPUs); each env trains on its own CUDA stream. None: the module's.
        engine: how hosts train: ``per_env`` or ``stacked``: envs whose hosts share an
            architecture (and whose seeds agree where two have one in a slot) train as one
            network mapped over them, in fewer kernel launches (not with ``compile`` or
            ``amp=fp16``); ``auto`` (default): stacked where every host is on a GPU,
            per_env elsewhere.
        cuda_graphs: on a GPU each stacked group, and each env training on its own,
            records its training step as a CUDA graph once an epoch and replays it: a
            step's launches become one; so does the PPO update its minibatch passes, once
            a run (``esper.simic.ppo_graph``; one process, no autocast), and the rollout
            the policy's act (``esper.mdp.recorded_act``; no autocast). Results are
            unchanged; not with ``compile`` or ``amp=fp16``; off by default until measured
            on a GPU (benchmarks/README.md).
        learner_device: where the PPO update runs: None (default) where the policy acts
            (the hosts' device); ``cpu`` on a copy of the policy on the CPU while it acts
            on the GPU, for an update of many small operators that a GPU's launching
            thread would pay for one by one (``esper.simic.learner``). One process,
            ``32-true`` precision.
    """

    def __init__(
        self,
        n_envs: int = 4,
        episode_epochs: int = 25,
        host: str = "cnn",
        host_kwargs: Mapping[str, Any] | None = None,
        blueprints: list[str] | None = None,
        widen_init: str = "random",
        reward: str = "shaped",
        lifecycle: LifecycleConfig | None = None,
        host_optim: OptimConfig | None = None,
        rewards: RewardConfig | None = None,
        policy: PolicyConfig | None = None,
        ppo: PPOConfig | None = None,
        normalizer: NormalizerConfig | None = None,
        ent_coef_final: float | None = None,
        on_oom: str = "raise",
        compile: bool = False,
        amp: str = "off",
        devices: list[str] | None = None,
        engine: str = "auto",
        learner_device: str | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if host_kwargs is None:
            host_kwargs = DEFAULT_HOST_KWARGS.get(host, {})
            self.hparams["host_kwargs"] = dict(host_kwargs)  # checkpoints name what was built
        self.automatic_optimization = False
        self.env_config = EnvConfig(
            n_envs=n_envs,
            episode_epochs=episode_epochs,
            host=host,
            host_kwargs=dict(host_kwargs),
            blueprints=tuple(blueprints) if blueprints is not None else None,
            widen_init=widen_init,
            reward=reward,
            lifecycle=as_config(LifecycleConfig, lifecycle),
            optim=as_config(OptimConfig, host_optim),
            rewards=as_config(RewardConfig, rewards),
            on_oom=on_oom,
            compile=compile,
            amp=amp,
            devices=tuple(devices) if devices is not None else None,
            engine=engine,
            cuda_graphs=cuda_graphs,
        )
        self.policy_config = as_config(PolicyConfig, policy)
        self.ppo_config = as_config(PPOConfig, ppo)
        self.normalizer_config = as_config(NormalizerConfig, normalizer)
        check_ent_coef_final(ent_coef_final)
        self.ent_coef_final = ent_coef_final
        self.learner_device = parse_learner_device(learner_device)
        #: The policy's copy that the update trains, on ``learner_device``; None: the
        #: update trains the acting policy itself.
        self._learner: LearnerCopy | None = None
        #: The PPO update's recorded minibatch passes (``cuda_graphs``), made at the first
        #: update that records, for the policy the update trains.
        self._recorded: RecordedMinibatches | None = None
        self.policy: PolicyNetwork | None = None
        self._obs_dim = 0
        self.normalizer: RunningObsNormalizer | None = None
        self.env: MorphogeneticVecEnv | None = None
        self.collector: PPOCollector | None = None
        self.last_summary: RolloutSummary | None = None
        self.last_metrics: dict[str, float] = {}
        self._generator = torch.Generator()
        #: Run state read from a checkpoint before setup built what it belongs to.
        self._pending_state: dict[str, Any] | None = None
        self._rng_to_restore: dict[str, Any] | None = None

    # ------------------------------------------------------------------ building
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if not isinstance(datamodule, HostDataModule):
            raise TypeError(
                "PPOModule needs a HostDataModule (e.g. esper.tolaria.data.DigitsDataModule) "
                f"passed as Trainer.fit(..., datamodule=...), got {type(datamodule).__name__}"
            )
        validate_run(self, datamodule, self.trainer.world_size)
        check_precision(str(self.trainer.precision))
        check_learner_run(self.learner_device, self.trainer.world_size, str(self.trainer.precision))
        strategy = self.trainer.strategy
        device = strategy.root_device
        world, rank = self.trainer.world_size, self.trainer.global_rank
        env_config = replace(
            self.env_config,
            n_envs=self.env_config.n_envs // world,
            pairing=self.ppo_config.pairing,
        )
        if world > 1:
            # Every rank was seeded alike; shift this rank's streams so its env group
            # initialises hosts, samples actions and shuffles data differently. The policy's
            # initial weights do not matter here: DDP broadcasts rank 0's.
            torch.manual_seed(torch.initial_seed() + rank * RANK_SEED_STRIDE)
        self.env = MorphogeneticVecEnv(env_config, datamodule, device)
        if world > 1:
            self.env.reseed_data(datamodule.seed + rank * RANK_SEED_STRIDE)
        self._build_policy(self.env.layout.dim, self.env.schema)
        assert self.policy is not None and self.normalizer is not None
        self.policy.to(device)
        self.normalizer.to(device)
        if self.learner_device is not None and self._learner is None:
            self._learner = LearnerCopy(self.policy, self.learner_device)
        buffer = RolloutBuffer(
            self.env.n_envs,
            self.env.decisions_per_episode,
            self.env.layout.dim,
            self.env.schema,
            (self.policy_config.lstm_layers, self.policy_config.hidden_size),
            device,
        )
        self.collector = PPOCollector(
            self.env,
            self.policy,
            self.normalizer,
            buffer,
            self.ppo_config.gamma,
            self.ppo_config.gae_lambda,
            compile=self.env_config.compile,
            policy_threads=self.policy_config.cpu_threads,
            cuda_graphs=self.env_config.cuda_graphs,
        )
        self.collector.seed_stride, self.collector.seed_offset = world, rank
        self.collector.set_governor(governor_among(self.trainer.callbacks))
        if world > 1:
            self.collector.reduce_sum = self._all_reduce_sum
        self._generator.manual_seed(int(torch.initial_seed()) % (2**63))
        if self._pending_state is not None:
            self._restore_run_state(self._pending_state)

    def _build_policy(self, obs_dim: int, schema: Any) -> None:
        if self.policy is not None:
            if self._obs_dim != obs_dim or self.policy.schema != schema:
                raise ValueError(
                    f"the policy expects observations of size {self._obs_dim} but this "
                    f"run's host and blueprints give {obs_dim}; resume with the same host, "
                    "data shape and blueprints"
                )
            return
        self._obs_dim = obs_dim
        self.policy = PolicyNetwork(obs_dim, schema, self.policy_config)
        self.normalizer = RunningObsNormalizer(obs_dim, self.normalizer_config)

    def configure_callbacks(self) -> list[Callback]:
        """What every fit of this module runs beside the trainer's callbacks: the objects
        alive at the fit's start kept out of full garbage collections
        (:class:`~esper.callbacks.gc_freeze.FreezeStartupObjects`), and the C heap's freed
        memory kept while it trains (:class:`~esper.callbacks.freed_memory.KeepFreedMemory`).
        Lightning lets these replace a trainer's callbacks of the same type; a process
        that tunes glibc's malloc itself (``GLIBC_TUNABLES``) keeps its settings."""
        return [FreezeStartupObjects(), KeepFreedMemory()]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.policy is not None, "setup() builds the policy before the optimizer"
        learning = self.policy if self._learner is None else self._learner.policy
        return make_optimizer(learning, self.ppo_config)

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Any, batch_idx: int) -> None:
        try:
            self._train_one_update()
        except RunFailure:
            raise
        except Exception as exc:
            raise RunFailure(self._failure_message(exc)) from exc

    def _failure_message(self, exc: BaseException) -> str:
        """What failed, and where the run's data is: the last complete update's checkpoint."""
        saved = newest_checkpoint(self.trainer)
        where = (
            f"the last checkpoint, written after update {self.current_epoch}, is {saved}; "
            "resume with --ckpt_path last"
            if saved is not None
            else "no update had completed, so there is no checkpoint to resume from"
        )
        return (
            f"update {self.current_epoch + 1} stopped: {type(exc).__name__}: {exc}. "
            f"Nothing of earlier updates is lost: {where}"
        )

    def _train_one_update(self) -> None:
        assert self.collector is not None and self.policy is not None
        summary = self._collect()
        optimizer = self.optimizers()
        lr = self._lr()
        for group in optimizer.param_groups:  # type: ignore[union-attr]
            group["lr"] = lr
        policy, batch, learner = self.policy, self._batch, self._learner
        if learner is not None:  # the update trains the copy, from the policy's weights
            learner.pull(self.policy)
            policy, batch = learner.policy, batch.to(learner.device)
        with intra_op_threads(self.policy_config.cpu_threads):
            stats = ppo_update(
                policy,
                optimizer,  # type: ignore[arg-type]
                batch,
                self.ppo_config,
                ent_coef=self._ent_coef(),
                generator=self._generator,
                backward=self.manual_backward,
                minibatch_passes=self._minibatch_passes(policy),
            )
        if learner is not None:
            learner.push(self.policy)
        names = sorted(stats)
        values = read_packed(torch.stack([stats[n].float() for n in names]))
        metrics = {f"ppo/{n}": float(v) for n, v in zip(names, values, strict=True)}
        metrics["ppo/lr"] = lr
        metrics.update(rollout_metrics(summary))
        self.last_metrics = metrics
        for name, value in metrics.items():
            self.log(
                name,
                value,
                on_step=False,
                on_epoch=True,
                batch_size=1,
                prog_bar=name in PROGRESS_BAR_METRICS,
                sync_dist=True,  # means over ranks, logged by rank 0
            )
        self._hooks()("on_ppo_update_end", dict(metrics))

    def _minibatch_passes(self, policy: PolicyNetwork) -> RecordedMinibatches | None:
        """The update's minibatch passes recorded and replayed (``esper.simic.ppo_graph``),
        where ``cuda_graphs`` asks and ``policy``'s device records; None: they run as they
        are. Not under DDP (its gradient hooks are not tried with recorded gradients) nor
        under autocast (a recording cannot hold autocast's cache of cast weights)."""
        if not self.env_config.cuda_graphs or self.trainer.world_size > 1:
            return None
        device = next(policy.parameters()).device
        if torch.is_autocast_enabled(device.type):
            return None
        if self._recorded is None or self._recorded.policy is not policy:
            # Its own recorder: a failed recording stops this update's, not the host steps'.
            recorder = own_recorder(device)
            if recorder is None:
                return None
            self._recorded = RecordedMinibatches(policy, self.ppo_config, recorder)
        return self._recorded

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def _hooks(self) -> RolloutHooks:
        return RolloutHooks(self.trainer.callbacks, self.trainer, self)

    def _collect(self) -> RolloutSummary:
        assert self.collector is not None and self.env is not None
        hooks = self._hooks()
        hooks("on_rollout_start", self.current_epoch)

        def on_step(batch: StepBatch) -> None:
            hooks("on_env_step", batch)

        # Outside the trainer's autocast (its precision is the PPO update's): hosts train
        # at ``amp``'s precision, and their weights move every step, which the casts an
        # autocast region keeps would not see.
        with torch.autocast(self.env.device.type, enabled=False):
            self._batch, summary = self.collector.collect_batch(self.current_epoch, on_step=on_step)
        hooks("on_rollout_end", summary)
        self.last_summary = summary
        return summary

    def _lr(self) -> float:
        return learning_rate_at(self.ppo_config, self.current_epoch, self.trainer.max_epochs or 1)

    def _ent_coef(self) -> float:
        total = self.trainer.max_epochs or 1
        return entropy_coef_at(
            self.ppo_config.ent_coef, self.ent_coef_final, self.current_epoch, total
        )

    # --------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Everything beyond weights and optimiser that a resumed run needs to continue exactly."""
        assert self.policy is not None and self.env is not None
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = plain(dict(checkpoint["hyper_parameters"]))
        checkpoint[SPEC_KEY] = policy_spec(self._obs_dim, self.policy.schema)
        checkpoint[DATA_KEY] = data_entry(self.env.datamodule)
        checkpoint[ENVS_PER_RANK_KEY] = self.env.n_envs
        checkpoint[RUN_STATE_KEY] = {
            "ppo_generator": self._generator.get_state(),
            "host_loader_generator": self.env.train_loader_generator_state(),
            "rng": capture_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        where = getattr(getattr(self, "_trainer", None), "ckpt_path", None) or "the checkpoint"
        schema, obs_dim = checkpoint_policy_spec(checkpoint, where)
        if self.policy is not None:
            check_same_action_space(schema, self.policy.schema, where)
        self._build_policy(obs_dim, schema)
        state = checkpoint.get(RUN_STATE_KEY)
        if state is not None:
            if self.env is not None:
                self._restore_run_state(state)
            else:
                self._pending_state = state

    def _restore_run_state(self, state: dict[str, Any]) -> None:
        assert self.env is not None
        self._generator.set_state(state["ppo_generator"])
        self.env.set_train_loader_generator_state(state["host_loader_generator"])
        # Applied when training starts: Lightning draws random numbers between loading a
        # checkpoint and the first epoch, and an uninterrupted run did not draw those.
        self._rng_to_restore = state["rng"]
        self._pending_state = None

    def on_train_start(self) -> None:
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
