"""The ``esper`` command.

``esper fit`` trains the growth policy with Lightning's CLI: ``--config FILE``, dotted
overrides (``--model.n_envs 8``, ``--trainer.max_epochs 20``, ``--data.batch_size 64``) and
``--print_config`` work as LightningCLI users expect. With no arguments it trains on the
embedded digits data and prints a summary of the last rollout.

``esper plugins`` lists what the registries hold after loading entry points: a plugin
author's first check that their package is seen, and where each name comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import logging
import shlex
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from esper import __version__
from esper.help_format import EsperArgumentParser


def _plugins(_: argparse.Namespace) -> int:
    # Imported here so `esper --help` stays fast: these pull in torch and Lightning.
    from esper.callbacks import CALLBACKS
    from esper.kasmina import BLUEPRINTS, HOSTS
    from esper.plugins import Registry
    from esper.simic.rewards import REWARDS
    from esper.tolaria.data import DATAMODULES

    registries: tuple[Registry[object], ...] = (  # type: ignore[assignment]
        BLUEPRINTS,
        HOSTS,
        DATAMODULES,
        REWARDS,
        CALLBACKS,
    )
    for registry in registries:
        print(f"{registry.kind}s (entry-point group {registry.group}):")
        names = registry.names()
        if not names:
            print("  (none)")
        for name in names:
            print(f"  {name:<14} {registry.entry(name).source}")
    return 0


#: Episodes per controller for ``esper evaluate``: enough for a standard error.
DEFAULT_EVAL_EPISODES = 8

#: Callbacks ``esper fit`` enables by registry name unless ``--callbacks`` says otherwise.
DEFAULT_CALLBACKS: tuple[str, ...] = (
    "telemetry",
    "governor",
    "timeline",
    # best before last: last.ckpt then holds the best-so-far decided in the same update
    "best_checkpoint",
    "last_checkpoint",
)

#: Added to the callbacks when stdout is not a terminal, in place of the progress bar.
PLAIN_PROGRESS = "progress_lines"

#: Defaults for ``esper fit`` with no arguments: a short run on the embedded digits data.
DEFAULT_DATA = "esper.tolaria.data.DigitsDataModule"
DEFAULT_MAX_EPOCHS = 60
FIT_TRAINER_DEFAULTS: dict[str, object] = {
    "max_epochs": DEFAULT_MAX_EPOCHS,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}


#: The logger Lightning's ``seed_everything`` reports on.
SEED_LOGGER = "lightning.fabric.utilities.seed"
#: ``--ckpt_path`` words that Lightning resolves itself rather than naming a file.
LIGHTNING_CKPT_WORDS = frozenset({"last", "best", "hpc"})
#: Errors that mean the user's input (a path, a file, a value) is wrong, not that Esper is:
#: shown as one line naming the input, with no traceback.
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def _input_error(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that names bad input, or None for a genuine failure.

    LightningCLI and jsonargparse wrap what the data module or a config raised in errors
    of their own ("Does not validate against any of the Union subtypes"), so the cause
    chain is searched for the original.
    """
    from esper.callbacks.checkpoint import CheckpointError
    from esper.simic.validation import config_error_from, exception_chain

    keyed = config_error_from(exc)
    if keyed is not None:
        return keyed
    return next(
        (
            link
            for link in exception_chain(exc)
            if isinstance(link, (CheckpointError, *INPUT_ERRORS))
        ),
        None,
    )


class _RunFolderGuard:
    """Removes the run folder a failed start created, so bad input leaves nothing behind.

    Lightning creates ``lightning_logs/version_N`` (config.yaml, events) as the run sets
    up, before Esper can check a checkpoint against the data or the run's config as a
    whole; when such a check fails, the folder holds no result. A folder that existed
    before the run is never touched.
    """

    def __init__(self) -> None:
        self._created: list[Path] = []

    def watch(self, folders: Sequence[Path]) -> None:
        """Remember which of ``folders`` (outermost first) this run is about to create."""
        self._created = [f for f in folders if not f.exists()]

    def remove_created(self) -> None:
        for folder in reversed(self._created):
            if folder.is_dir():
                shutil.rmtree(folder)


#: Where Lightning's rank-zero messages go; its litlogger advert is one of them.
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


def _drop_advert(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def _quiet_third_party() -> None:
    """No adverts or deprecation notices of libraries in a normal run (they are not ours
    to act on): Lightning's litlogger tip, and torch's LeafSpec deprecation that
    Lightning's own pytree helper triggers."""
    logging.getLogger(LIGHTNING_INFO_LOGGER).addFilter(_drop_advert)
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
    )


def _data_names_as_class_paths(argv: Sequence[str]) -> list[str]:
    """``--data NAME`` (and ``--data.help NAME``) with a registry name as its class path.

    LightningCLI takes a class path or a class name after ``--data``; Esper's registry
    names (``digits``, ``tokens``, a plugin's name; ``esper plugins`` lists them) work
    wherever those do.
    """
    from esper.tolaria.data import DATAMODULES

    def resolve(name: str) -> str:
        if name not in DATAMODULES:
            return name
        cls = DATAMODULES.get(name)
        return f"{cls.__module__}.{cls.__qualname__}"

    out = list(argv)
    for i, word in enumerate(out):
        option, eq, value = word.partition("=")
        if option not in ("--data", "--data.help"):
            continue
        if eq:
            out[i] = f"{option}={resolve(value)}"
        elif i + 1 < len(out):
            out[i + 1] = resolve(out[i + 1])
    return out


def _data_keys_given(argv: Sequence[str]) -> set[str]:
    """Init args named on the command line (``--data.x`` or ``--data.init_args.x``)."""
    keys = set()
    for word in argv:
        if word.startswith("--data."):
            key = word[len("--data.") :].split("=", 1)[0]
            keys.add(key.removeprefix("init_args."))
    return keys


def _drop_carried_defaults(data: Any, given: set[str]) -> None:
    """Reset init args that ``--data OtherClass`` carried over from the default data class.

    jsonargparse keeps the default class's init args when another class is chosen, if the
    new class accepts them (jsonargparse issue #460): ``--data TokenSequenceDataModule``
    would inherit the digits ``val_fraction``, which synthetic tokens refuse. An init arg
    equal to the default class's default, where the chosen class's own default differs,
    is taken as carried over and set back to the chosen class's default, unless the
    command line names it (``given``).
    """
    own = _init_defaults(_import_class(data["class_path"]))
    default = _init_defaults(_import_class(DEFAULT_DATA))
    init_args = data.get("init_args")
    if init_args is None:
        return
    for name in list(vars(init_args)):
        carried = name in own and name in default and init_args[name] == default[name] != own[name]
        if carried and name not in given:
            init_args[name] = own[name]


def _record_resolved_configs(model_config: Any, module: Any) -> None:
    """Put the configs the run uses into the config LightningCLI saves (``config.yaml``),
    where a left-out config reads ``null``: the file then repeats the run by itself."""
    from jsonargparse import Namespace

    env = module.env_config
    resolved = {
        "lifecycle": env.lifecycle,
        "host_optim": env.optim,
        "rewards": env.rewards,
        "policy": module.policy_config,
        "ppo": module.ppo_config,
        "normalizer": module.normalizer_config,
    }
    for key, config in resolved.items():
        model_config[key] = Namespace(**dataclasses.asdict(config))
    model_config["host_kwargs"] = dict(env.host_kwargs)


def _bar(trainer_config: dict[str, Any]) -> list[Any]:
    """Esper's bar over host epochs where Lightning would show its own (one that counts
    the single batch of an update), unless the run brings a progress bar of its own."""
    from lightning.pytorch.callbacks import ProgressBar

    from esper.callbacks.progress import UpdateProgressBar

    given = trainer_config.get("callbacks") or []
    if not trainer_config.get("enable_progress_bar", True) or any(
        isinstance(cb, ProgressBar) for cb in given
    ):
        return []
    return [UpdateProgressBar()]


def _with_checkpoint_io(plugins: Any) -> list[Any]:
    """The run's Trainer plugins, with :class:`EsperCheckpointIO` (atomic writes, safe
    loads, errors that name the file) unless the run brings a CheckpointIO of its own."""
    from lightning.fabric.plugins import CheckpointIO

    from esper.callbacks.checkpoint import EsperCheckpointIO

    given = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    if any(isinstance(plugin, CheckpointIO) for plugin in given):
        return given
    return [*given, EsperCheckpointIO()]


def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _init_defaults(cls: type) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def _trainer_group_after_esper_groups(parser: Any) -> None:
    """Show Esper's option groups (model, data) in ``--help`` before Lightning's long
    Trainer group, which LightningCLI adds first.

    Only the help changes: argparse prints groups in ``_action_groups`` order, while
    parsing, defaults and the saved config follow the parser's actions, and the Trainer
    group is not one the parser instantiates. Left as it is if the group is not there.
    """
    trainer = parser.groups.get("trainer")
    groups = parser._action_groups
    if trainer is not None and trainer in groups:
        groups.remove(trainer)
        groups.append(trainer)


def fit(argv: Sequence[str] | None = None) -> int:
    """Run ``LightningCLI`` on :class:`PPOModule` and a :class:`HostDataModule`.

    ``argv`` are the arguments after ``fit``; None reads them from ``sys.argv``. Bad input
    (a config value, a data path, a checkpoint file) ends the run with one line on stderr
    naming it and exit status 2, and leaves no run folder behind.
    """
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    from esper.callbacks import CALLBACKS
    from esper.callbacks.checkpoint import (
        CheckpointError,
        find_last_checkpoint,
        read_checkpoint,
        run_folder_of,
    )
    from esper.simic.env_config import action_schema
    from esper.simic.module import (
        PPOModule,
        RunFailure,
        check_same_action_space,
        checkpoint_policy_spec,
    )
    from esper.simic.validation import ConfigError
    from esper.tolaria.data import HostDataModule

    guard = _RunFolderGuard()
    _quiet_third_party()
    # A bar in a file is carriage-return noise: plain lines, one per update, instead.
    on_terminal = sys.stdout.isatty()

    class EsperCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})
            parser.add_argument(
                "--callbacks",
                type=list[str],
                default=list(DEFAULT_CALLBACKS) + ([] if on_terminal else [PLAIN_PROGRESS]),
                help=(
                    "callbacks to enable by registry name, built with their defaults "
                    f"(built-in and entry-point plugins: {', '.join(CALLBACKS.names())}); "
                    "use --trainer.callbacks for ones that need arguments"
                ),
            )
            _trainer_group_after_esper_groups(parser)

        def before_instantiate_classes(self) -> None:
            data = self._get(self.config, "data")
            if data is not None and data.get("class_path") != DEFAULT_DATA:
                given = sys.argv[1:] if argv is None else argv
                _drop_carried_defaults(data, _data_keys_given(given))

        def _parse_ckpt_path(self) -> None:
            # LightningCLI reads the file's hyperparameters into the config here, with a
            # bare torch.load; read and check it first so a bad file is named in one line.
            self._resume_from: tuple[str, Any] | None = None
            run_config = self.config[self.config.subcommand]
            ckpt_path = run_config.get("ckpt_path")
            if str(ckpt_path) == "last":
                # Resolved here, not by Lightning: the newest last.ckpt of the runs under
                # the root, whose run folder this run then continues.
                root = Path(run_config["trainer"].get("default_root_dir") or ".")
                found = find_last_checkpoint(root)
                if found is None:
                    raise CheckpointError(
                        f"--ckpt_path last: no run under {root.absolute()} has a last.ckpt "
                        "(looked in */*/checkpoints and checkpoints); pass the .ckpt path, "
                        "set --trainer.default_root_dir to the folder the run was in, or "
                        "start afresh without --ckpt_path"
                    )
                ckpt_path = run_config["ckpt_path"] = str(found)
            if ckpt_path and str(ckpt_path) not in LIGHTNING_CKPT_WORDS:
                if str(ckpt_path).startswith("registry"):
                    raise CheckpointError(
                        f"--ckpt_path {ckpt_path}: esper resumes from files only; pass a "
                        ".ckpt path or `last`"
                    )
                checkpoint = read_checkpoint(ckpt_path)
                schema, _ = checkpoint_policy_spec(checkpoint, ckpt_path)
                self._resume_from = (str(ckpt_path), schema)
                self._refuse_finished(checkpoint, str(ckpt_path))
            super()._parse_ckpt_path()

        def _refuse_finished(self, checkpoint: dict[str, Any], name: str) -> None:
            """A run that already made its ``max_epochs`` updates would resume to do
            nothing; say so, and how to train further, before any folder is made."""
            done = int(checkpoint.get("epoch", -1)) + 1
            max_epochs = self.config[self.config.subcommand]["trainer"].get("max_epochs")
            if max_epochs is not None and 0 <= max_epochs <= done:
                raise CheckpointError(
                    f"--ckpt_path {name}: this run already made its {done} PPO update(s) "
                    f"(trainer.max_epochs={max_epochs}); to train it further, resume with "
                    f"--trainer.max_epochs {done + max(done, 1)} (or any number above {done})"
                )

        def _set_seed(self) -> None:
            # Lightning logs "Seed set to N" here, before any input is checked; said in
            # before_fit instead, so a run refused for bad input prints one line only.
            seed_logger = logging.getLogger(SEED_LOGGER)
            level = seed_logger.level
            seed_logger.setLevel(logging.WARNING)
            try:
                super()._set_seed()
            finally:
                seed_logger.setLevel(level)

        def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
            names = self._get(self.config_init, "callbacks") or []
            unknown = [n for n in names if n not in CALLBACKS]
            if unknown:
                raise ConfigError(
                    "callbacks",
                    f"--callbacks names unknown callbacks {unknown}; "
                    f"known: {list(CALLBACKS.names())}",
                )
            self._check_resume_fits_this_run()
            self._continue_resumed_run_folder(config)
            named = [CALLBACKS.get(name)() for name in names]
            config["plugins"] = _with_checkpoint_io(config.get("plugins"))
            return super()._instantiate_trainer(config, [*callbacks, *named, *_bar(config)])

        def _continue_resumed_run_folder(self, config: dict[str, Any]) -> None:
            """A run resumed from a checkpoint in its run folder logs on in that folder:
            one TensorBoard run, one events.jsonl, checkpoints where they were. Only with
            the default logger: one the user configured decides for itself."""
            if self._resume_from is None or config.get("logger") not in (None, True):
                return
            run = run_folder_of(Path(self._resume_from[0]))
            if run is None:
                return
            from lightning.pytorch.loggers import TensorBoardLogger

            config["logger"] = TensorBoardLogger(
                save_dir=run.save_dir, name=run.name, version=run.version
            )
            # The folder's config.yaml is replaced by this run's (same run, resumed).
            self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}

        def _check_resume_fits_this_run(self) -> None:
            """Refuse a checkpoint with another action space before the Trainer is built."""
            if self._resume_from is None or not isinstance(self.datamodule, HostDataModule):
                return
            path, trained = self._resume_from
            try:
                run = action_schema(self.model.env_config, self.datamodule)
            except (ValueError, TypeError):
                return  # a bad host or blueprint setting: setup names it by its key
            check_same_action_space(trained, run, path)

        def after_instantiate_classes(self) -> None:
            super().after_instantiate_classes()
            _record_resolved_configs(self._get(self.config, "model"), self.model)

        def before_fit(self) -> None:
            seed = self._get(self.config, "seed_everything")
            if seed is not False:
                logging.getLogger(SEED_LOGGER).info(f"Seed set to {seed}")
            log_dir = self.trainer.log_dir or self.trainer.default_root_dir
            run_dir = Path(log_dir).absolute()
            guard.watch([*reversed(run_dir.parents), run_dir])
            started.append(self)

    started: list[LightningCLI] = []
    try:
        cli = EsperCLI(
            PPOModule,
            HostDataModule,
            subclass_mode_data=True,
            # PPOModule builds its own optimiser (manual optimisation): Lightning's
            # --optimizer / --lr_scheduler options would be offered and then crash.
            auto_configure_optimizers=False,
            trainer_defaults={**FIT_TRAINER_DEFAULTS, "enable_progress_bar": on_terminal},
            seed_everything_default=0,
            args=None if argv is None else ["fit", *argv],
            parser_class=EsperArgumentParser,
            parser_kwargs={"prog": "esper"},
        )
    except Exception as exc:  # from parsing, building the run, or PPOModule.setup
        # A RunFailure is a fault during training: its message already says where the
        # checkpoint is, and the run folder holds what the updates before it wrote.
        error = None if isinstance(exc, RunFailure) else _input_error(exc)
        if error is None:
            raise
        guard.remove_created()
        message = " ".join(str(error).split())  # one line, whatever the source wrote
        print(f"esper fit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit:
        # Lightning answers Ctrl-C by tearing the run down and calling sys.exit(1).
        if started and started[0].trainer.interrupted:
            given = sys.argv[2:] if argv is None else list(argv)
            print(format_interrupt(started[0].trainer, started[0].model, given), file=sys.stderr)
        raise
    print(format_summary(cli.model))
    return 0


def format_interrupt(trainer: Any, module: Any, argv: Sequence[str]) -> str:
    """What ``esper fit`` says when stopped by Ctrl-C: the last update, the last
    checkpoint, and the command that resumes the run from it."""
    from esper.callbacks.checkpoint import newest_checkpoint

    saved = newest_checkpoint(trainer)
    lines = [f"esper fit: interrupted during update {trainer.current_epoch + 1}."]
    if getattr(module, "last_summary", None) is not None:
        lines.append(format_summary(module).replace("esper fit: ", "last rollout: ", 1))
    if saved is None or not saved.is_file():
        lines.append("No update completed, so there is no checkpoint to resume from.")
        return "\n".join(lines)
    kept = _without_ckpt_path(list(argv))
    lines += [
        f"last checkpoint: {saved}",
        "resume with:",
        "  " + shlex.join(["esper", "fit", *kept, "--ckpt_path", str(saved)]),
    ]
    return "\n".join(lines)


def _without_ckpt_path(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--ckpt_path":
            skip = True
        elif not word.startswith("--ckpt_path="):
            out.append(word)
    return out


def format_summary(module: object) -> str:
    """The closing lines of ``esper fit``: what the last rollout measured."""
    summary = getattr(module, "last_summary", None)
    if summary is None:
        return "esper fit: no rollout completed"
    metrics = getattr(module, "last_metrics", {})
    lines = [
        f"esper fit: {summary.rollout + 1} PPO update(s), last rollout over "
        f"{len(summary.episode_return)} envs:",
        f"  episode return     {summary.episode_return.mean():+.4f} (mean over envs)",
        f"  host val accuracy  {summary.final_val_acc.mean():.4f}",
        f"  seeds fossilized   {summary.seeds_fossilized.mean():.2f} per env "
        f"(germinated {summary.seeds_germinated.mean():.2f}, pruned {summary.seeds_pruned.mean():.2f})",
        f"  parameters added   {summary.params_added.mean():.0f} per env",
        f"  env steps/s        {summary.env_steps_per_s:.2f}",
    ]
    if "ppo/approx_kl" in metrics:
        lines.append(
            f"  ppo                policy loss {metrics['ppo/policy_loss']:+.4f}, "
            f"value loss {metrics['ppo/value_loss']:.4f}, entropy {metrics['ppo/entropy']:.3f}"
        )
    return "\n".join(lines)


def _say_done(result: Any) -> None:
    """Progress of ``esper evaluate``: one line per controller as it finishes."""
    print(
        f"  {result.controller:<10} {result.episodes} episode(s) in {result.wall_s:.0f} s, "
        f"final val acc {result.final_val_acc_mean:.4f}",
        file=sys.stderr,
        flush=True,
    )


def _evaluate(args: argparse.Namespace) -> int:
    from esper.callbacks.checkpoint import find_last_checkpoint
    from esper.simic.evaluate import evaluate

    ckpt = Path(args.ckpt)
    if args.ckpt == "last":
        found = find_last_checkpoint(Path("."))
        if found is None:
            print(
                "esper evaluate: error: --ckpt last: no run under this folder has a last.ckpt "
                "(looked in */*/checkpoints and checkpoints); pass the .ckpt path",
                file=sys.stderr,
            )
            return 2
        ckpt = found
    out = Path(args.out) if args.out else ckpt.resolve().parent.parent / "evaluation"
    try:
        result = evaluate(
            ckpt,
            episodes=args.episodes,
            seed=args.seed,
            device=args.device,
            sample=args.sample,
            on_controller_done=_say_done,
        )
    except Exception as exc:
        error = _input_error(exc)
        if error is None:
            raise
        message = " ".join(str(error).split())
        print(f"esper evaluate: error: {message}", file=sys.stderr)
        return 2
    policy = "sampled" if args.sample else "most likely action per head"
    print(
        f"esper evaluate: {args.episodes} episode(s) per controller, seed {args.seed}, "
        f"learned policy {policy}, {ckpt}"
    )
    print(result.table())
    for kind, path in result.write(out).items():
        print(f"  {kind:<4} {path}")
    timelines = result.write_timelines(out / "timelines")
    print(f"  {len(timelines)} timeline pictures in {out / 'timelines'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from esper.report import report

    try:
        written = report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"esper report: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="esper", description="Train networks that grow, steered by a PPO policy."
    )
    parser.add_argument("--version", action="version", version=f"esper {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    plugins = commands.add_parser(
        "plugins", help="list blueprints, hosts, data, rewards and callbacks"
    )
    plugins.set_defaults(run=_plugins)
    commands.add_parser(
        "fit", help="train the growth policy (LightningCLI; `esper fit --help` for options)"
    )
    ev = commands.add_parser(
        "evaluate",
        help="compare the learned policy with the heuristic, random and no-growth controllers",
    )
    ev.add_argument(
        "--ckpt",
        required=True,
        help="a checkpoint written by esper fit, or `last`: the newest run's last.ckpt "
        "under the current folder",
    )
    ev.add_argument("--episodes", type=int, default=DEFAULT_EVAL_EPISODES)
    ev.add_argument("--seed", type=int, default=0, help="evaluation seed (never used in training)")
    ev.add_argument("--device", default="cpu")
    ev.add_argument(
        "--sample",
        action="store_true",
        help="draw the learned policy's actions from its distribution (as in training) "
        "instead of taking each head's most likely choice",
    )
    ev.add_argument("--out", default=None, help="output folder (default: <run dir>/evaluation)")
    ev.set_defaults(run=_evaluate)
    rep = commands.add_parser(
        "report", help="draw learning_curve.png beside each events.jsonl under a run directory"
    )
    rep.add_argument("run_dir", type=Path, help="the run's folder (e.g. its default_root_dir)")
    rep.set_defaults(run=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "fit":
        if argv is not None:
            return fit(_data_names_as_class_paths(words[1:]))
        # From the console LightningCLI reads sys.argv itself ("fit" is its subcommand).
        sys.argv[2:] = _data_names_as_class_paths(words[1:])
        return fit(None)
    args = build_parser().parse_args(words)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
