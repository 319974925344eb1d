"""The vectorised environment: ``n_envs`` growing hosts that train one epoch per step.

Python owns the lifecycle (stages, which seed sits where, parameter counts); the device
owns the numbers (losses, accuracies, contributions). The env keeps that split: its
device-side outputs (observation, masks, metrics) are tensors the rollout loop packs into
the step's single transfer, and it applies actions from the host-side copy it gets back
(:mod:`esper.mdp.lifecycle_ops` carries them out). The env keeps no per-slot state of its
own: stages, clocks and gate refusals live on each seed's lifecycle, inside the host, so a
governor's snapshot of a host is a snapshot of everything the env observes about it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from esper.contracts import ActionSchema, ObservationLayout
from esper.contracts.rollout import LifecycleEvent
from esper.contracts.stages import CONTRIBUTING_STAGES
from esper.kasmina import BLUEPRINTS, GrowingHost, HostModel, clock
from esper.kasmina.architecture import Architecture, build_architecture
from esper.mdp.env_config import EnvConfig, blueprint_names, build_host
from esper.mdp.lifecycle_ops import OpApplier, StepOutcome, lifecycle_event, seed_key
from esper.mdp.rewards import REWARDS, RewardFn, RewardInputs
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.features import EnvState, ObservationBuilder, SlotState
from esper.tamiyo.masks import MaskBuilder
from esper.tolaria.compute import TrainingCompute
from esper.tolaria.data.base import HostDataModule
from esper.tolaria.epoch import EpochResult, run_epoch
from esper.tolaria.step_graph import RECORDERS

__all__ = ["HostDataError", "MorphogeneticVecEnv", "StepOutcome"]


class HostDataError(RuntimeError):
    """The host data pipeline failed (e.g. a DataLoader worker died)."""


class MorphogeneticVecEnv:
    """``n_envs`` hosts trained in lock-step, one host epoch per step."""

    def __init__(
        self,
        config: EnvConfig,
        datamodule: HostDataModule,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.datamodule = datamodule
        self.device = torch.device(device)
        probe = build_host(config, datamodule)
        self.slot_ids = probe.slot_ids
        shapes = [probe.slot(s).shape for s in self.slot_ids]
        names = blueprint_names(config, probe)
        self.blueprint_names = names
        self.schema = ActionSchema(self.slot_ids, self.blueprint_names)
        self.blend_modes = self.schema.blend_modes
        bps = [BLUEPRINTS.get(n) for n in names]
        fits = np.array([[bp.fits(sh) for bp in bps] for sh in shapes], dtype=bool)
        params = np.array(
            [
                [bp.param_count(sh) if f else 0 for bp, f in zip(bps, row, strict=True)]
                for sh, row in zip(shapes, fits, strict=True)
            ],
            dtype=np.int64,
        )
        self.layout = ObservationLayout(len(self.slot_ids), len(names))
        budget = config.rewards.param_budget
        self.masks = MaskBuilder(self.schema, fits, params, budget, config.lifecycle)
        self.observations = ObservationBuilder(
            self.layout, config.episode_epochs, budget, self.device
        )
        self.reward_fn: RewardFn = REWARDS.get(config.reward)
        self._bp_index = {n: i for i, n in enumerate(names)}
        self._ops = OpApplier(self.slot_ids, names, self.blend_modes, self.masks)
        # Built once: the train loader's generator then advances, so epochs differ in order.
        self._train_loader = datamodule.host_train_dataloader()
        self._val_loader = datamodule.host_val_dataloader()
        self._columns = {name: i for i, name in enumerate(self.metric_columns())}
        self.hosts: list[GrowingHost] = []
        #: Per env, a final architecture to build into its host at every reset (the
        #: ``static_final`` control: a grown network trained from the start); None: none.
        self.initial_architectures: Sequence[Architecture | None] | None = None
        #: Set to count training FLOPs (``esper.tolaria.compute``); evaluation does, the
        #: training loop does not need to.
        self.compute: TrainingCompute | None = None
        #: ``[E]`` training FLOPs of each env's host and seeds since the last reset
        #: (zeros unless ``compute`` is set).
        self.train_flops = np.zeros(config.n_envs)
        #: Training predictions of every env since the env was built, and of those the
        #: ones trained in a stacked group (``EnvConfig.engine``): host-side counts.
        self.predictions_trained = 0
        self.predictions_stacked = 0
        self.host_epoch = 0
        self.result: EpochResult | None = None
        self._prev_val_acc = torch.zeros(config.n_envs, device=self.device)
        self._best_val_acc = torch.zeros(config.n_envs, device=self.device)
        self._mask_arrays: dict[str, np.ndarray] = {}
        self._events: list[LifecycleEvent] = []
        self.episode_seed = 0
        #: How every host epoch trains: built and checked once, handed whole to run_epoch.
        self.host_training = config.host_training
        #: fp16 gradient scalers, one per device, kept across epochs and episodes.
        self._scalers: dict[torch.device, torch.amp.GradScaler] = {}
        listed = config.devices or (str(self.device),)
        #: Where each env's host lives: the listed devices, round-robin.
        self.host_devices = [torch.device(listed[e % len(listed)]) for e in range(config.n_envs)]
        if config.cuda_graphs and all(d.type not in RECORDERS for d in self.host_devices):
            warnings.warn(
                f"cuda_graphs: no host trains on a GPU here ({listed[0]}), so no step is "
                "recorded; results and speed are as without it",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ queries
    @property
    def n_envs(self) -> int:
        return self.config.n_envs

    @property
    def n_slots(self) -> int:
        return len(self.slot_ids)

    @property
    def decisions_per_episode(self) -> int:
        return self.config.episode_epochs - 1

    def epochs_in_stage(self) -> np.ndarray:
        """``[E, S]`` int epochs every slot has spent in its current stage."""
        return np.array(
            [
                [h.model.slot(s).lifecycle.epochs_in_stage for s in self.slot_ids]
                for h in self.hosts
            ],
            dtype=np.int64,
        ).reshape(self.n_envs, self.n_slots)

    def stages(self) -> np.ndarray:
        """``[E, S]`` int stage of every slot."""
        return np.array(
            [[int(h.model.slot(s).stage) for s in self.slot_ids] for h in self.hosts],
            dtype=np.int64,
        ).reshape(self.n_envs, self.n_slots)

    def seed_params(self) -> np.ndarray:
        """``[E]`` parameters seeds have added to each host (live and fossilized)."""
        return np.array([h.model.seed_param_count() for h in self.hosts], dtype=np.int64)

    def contributing(self) -> np.ndarray:
        """``[E, S]`` bool, slots whose seed's contribution counts for reward."""
        stages = self.stages()
        return np.isin(stages, [int(s) for s in CONTRIBUTING_STAGES])

    # ----------------------------------------------------------------- episode
    def reset(self, episode_seed: int = 0) -> None:
        """Fresh hosts, then the episode's first epoch.

        ``episode_seed`` keys the per-env generators seeds are initialised from.
        """
        self.episode_seed = episode_seed
        self._events = []
        group = self.config.paired_group
        if group is not None:
            firsts = [build_host(self.config, self.datamodule) for _ in range(self.n_envs // group)]
            models = [copy.deepcopy(firsts[e // group]) for e in range(self.n_envs)]
        else:
            models = [build_host(self.config, self.datamodule) for _ in self.host_devices]
        if self.initial_architectures is not None:
            self._build_initial_architectures(models, episode_seed)
        self.train_flops = np.zeros(self.n_envs)
        # Built on the CPU; uploaded without waiting for the device (a blocking upload
        # from pageable memory synchronises the stream: once per tensor of every host).
        self.hosts = [
            GrowingHost(
                model.to(device, non_blocking=True), self.config.optim, self.config.widen_init
            )
            for model, device in zip(models, self.host_devices, strict=True)
        ]
        self.host_epoch = 0
        self._prev_val_acc.zero_()
        self._best_val_acc.zero_()
        self.result = None
        self.train_epoch()

    def _build_initial_architectures(self, models: list[HostModel], episode_seed: int) -> None:
        """Build each env's initial architecture into its fresh host, its seeds drawn from
        a generator per (episode, env, slot) as germination draws them (at host epoch 0,
        when no germination happens): the hosts' own weights, drawn before, stay those
        every other controller's episodes start from."""
        architectures = self.initial_architectures
        assert architectures is not None
        if len(architectures) != self.n_envs:
            raise ValueError(
                f"initial_architectures lists {len(architectures)} envs; the env has {self.n_envs}"
            )
        for e, (model, architecture) in enumerate(zip(models, architectures, strict=True)):
            if architecture is not None:
                keys = [seed_key(episode_seed, e, 0, s) for s in range(len(architecture))]
                build_architecture(model, architecture, keys)

    def train_epoch(self) -> EpochResult:
        """One host epoch for every env; the lifecycle clocks tick after it."""
        progress = self.host_epoch / self.config.episode_epochs
        for host in self.hosts:
            host.set_progress(progress)
        compute = self.compute
        per_prediction = (
            None if compute is None else [compute.per_prediction(h) for h in self.hosts]
        )
        try:
            result = run_epoch(
                self.hosts,
                self._train_loader,
                self._val_loader,
                self.host_training,
                scalers=self._scalers,
                result_device=self.device,
            )
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc):
                raise
            raise HostDataError(
                f"a host data loader worker died during host epoch {self.host_epoch + 1} "
                f"({exc}); check the data module {type(self.datamodule).__name__} (its "
                "dataset, memory, or data.num_workers=0 to load in the main process)"
            ) from exc
        if compute is not None and per_prediction is not None:
            self.train_flops += compute.epoch_flops(per_prediction, result.train_predictions)
        self.predictions_trained += sum(result.train_predictions)
        self.predictions_stacked += sum(result.stacked_predictions)
        for e in result.skipped_envs:
            self._events.append(
                LifecycleEvent(
                    kind="oom_skip",
                    env=e,
                    reason="out of device memory; sat out the rest of the epoch",
                    host_epoch=self.host_epoch + 1,
                )
            )
        if self.result is not None:
            self._prev_val_acc = self.result.val_acc
        else:
            self._prev_val_acc = result.val_acc
        self._best_val_acc = torch.maximum(self._best_val_acc, result.val_acc)
        self.result = result
        self.host_epoch += 1
        for e, host in enumerate(self.hosts):
            for move in clock.after_epoch(host):
                self._events.append(
                    lifecycle_event(
                        "cooldown",
                        e,
                        host,
                        move.slot_id,
                        move.stage_from,
                        move.stage_to,
                        self.host_epoch,
                    )
                )
        return result

    def observe(self) -> tuple[Tensor, ActionMasks]:
        """The observation ``[E, D]`` and masks for the epoch just trained, on the device."""
        assert self.result is not None, "call reset() first"
        envs = [
            EnvState(
                host_epoch=self.host_epoch,
                seed_params=host.model.seed_param_count(),
                slots=[self._slot_state(host, s) for s in range(self.n_slots)],
            )
            for host in self.hosts
        ]
        obs = self.observations.build(self.result, self._prev_val_acc, self._best_val_acc, envs)
        stages = self.stages()
        seed_params = np.array([env.seed_params for env in envs], dtype=np.int64)
        epochs = self.epochs_in_stage()
        self._mask_arrays = self.masks.build_numpy(stages, seed_params, epochs)
        masks = self.masks.upload(self._mask_arrays, self.device)
        return obs, masks

    def _slot_state(self, host: GrowingHost, s: int) -> SlotState:
        slot = host.model.slot(self.slot_ids[s])
        bp = slot.lifecycle.blueprint
        return SlotState(
            stage=slot.stage,
            epochs_in_stage=slot.lifecycle.epochs_in_stage,
            alpha=slot.alpha,
            blueprint_index=self._bp_index.get(bp) if bp is not None else None,
            gate_refused=slot.lifecycle.refused,
        )

    @property
    def legal_op_counts(self) -> np.ndarray:
        """``[E]`` ops the current masks allow (a mask statistic for telemetry)."""
        return self._mask_arrays["op"].sum(axis=1)

    # ------------------------------------------------------------ device metrics
    def metric_columns(self) -> tuple[str, ...]:
        """Names of the columns of :meth:`metrics`, for unpacking the host copy."""
        per_slot = [f"contribution.{s}" for s in self.slot_ids]
        finite = [f"grads_finite.{s}" for s in self.slot_ids]
        return ("train_loss", "val_loss", "val_acc", "loss_finite", *per_slot, *finite)

    def metrics(self) -> Tensor:
        """``[E, K]`` float32 device metrics of the last epoch, columns as named above."""
        r = self.result
        assert r is not None, "call reset() first"
        return torch.cat(
            [
                r.train_loss[:, None],
                r.val_loss[:, None],
                r.val_acc[:, None],
                r.loss_finite[:, None].float(),
                r.contribution,
                r.seed_grads_finite.float(),
            ],
            dim=1,
        ).float()

    def reseed_data(self, seed: int) -> None:
        """Restart the host train loader's shuffling from ``seed`` (each DDP rank its own)."""
        generator = self._train_loader.generator
        assert generator is not None, "host train loaders are built with a generator"
        generator.manual_seed(seed)

    def train_loader_generator_state(self) -> Tensor:
        """The shuffling generator's state: a resumed run must continue the same order."""
        generator = self._train_loader.generator
        assert generator is not None, "host train loaders are built with a generator"
        return generator.get_state()

    def set_train_loader_generator_state(self, state: Tensor) -> None:
        generator = self._train_loader.generator
        assert generator is not None, "host train loaders are built with a generator"
        generator.set_state(state)

    def column(self, name: str) -> int:
        """Index of a scalar column of :meth:`metrics`."""
        return self._columns[name]

    def slot_columns(self, prefix: str) -> slice:
        first = self._columns[f"{prefix}.{self.slot_ids[0]}"]
        return slice(first, first + self.n_slots)

    # ------------------------------------------------------------------ actions
    def apply(
        self, actions: np.ndarray, metrics: np.ndarray, active: np.ndarray | None = None
    ) -> StepOutcome:
        """Apply host-side ``actions [E, 4]`` using gate signals from ``metrics [E, K]``.

        Envs where ``active`` is False (just rolled back by the governor) are skipped: their
        action was chosen from a state that no longer exists.
        """
        outcome, events = self._ops.apply(
            self.hosts,
            actions,
            contribution=metrics[:, self.slot_columns("contribution")],
            grads_finite=metrics[:, self.slot_columns("grads_finite")] > 0.5,
            mask_arrays=self._mask_arrays,
            active=active,
            host_epoch=self.host_epoch,
            episode_seed=self.episode_seed,
        )
        self._events.extend(events)
        return outcome

    def record(self, event: LifecycleEvent) -> None:
        """Add an event raised outside the env (the governor's), in order."""
        self._events.append(event)

    def drain_events(self) -> tuple[LifecycleEvent, ...]:
        """The events since the last call, oldest first."""
        events, self._events = tuple(self._events), []
        return events

    def mask_rates(self) -> dict[str, float]:
        """Per head, the fraction of its choices the current masks allow (host-side)."""
        return {name: float(m.mean()) for name, m in self._mask_arrays.items()}

    # ------------------------------------------------------------------ rewards
    def rewards(
        self,
        before: np.ndarray,
        after: np.ndarray,
        outcome: StepOutcome,
        terminal: bool,
        rollback: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """Named reward components ``[E]`` of a transition, from the metrics around it."""
        val_acc = self._columns["val_acc"]
        inputs = RewardInputs(
            val_acc=after[:, val_acc].astype(np.float64),
            prev_val_acc=before[:, val_acc].astype(np.float64),
            contribution=after[:, self.slot_columns("contribution")].astype(np.float64),
            blending=self.contributing(),
            seed_params=self.seed_params(),
            illegal_op=outcome.illegal,
            wasted_op=outcome.refused,
            fossilized=outcome.fossilized,
            terminal=np.full(self.n_envs, terminal),
            rollback=np.zeros(self.n_envs, dtype=bool) if rollback is None else rollback,
        )
        return self.reward_fn(inputs, self.config.rewards)
