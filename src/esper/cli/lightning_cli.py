"""``esper fit``: LightningCLI on :class:`PPOModule` and a :class:`HostDataModule`.

The subclass below hooks into LightningCLI where a run is built, in that order: the
parser's Esper options, the data class's own defaults, the checkpoint to resume from,
the seed, the Trainer with the named callbacks, and the saved config.
"""

from __future__ import annotations

import logging
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from esper.cli.bad_input import (
    BAD_INPUT_STATUS,
    RunFolderGuard,
    input_error,
    one_line,
    refused_trainer,
    try_writing_in,
)
from esper.cli.help_format import EsperArgumentParser
from esper.cli.options import (
    DEFAULT_CALLBACKS,
    DEFAULT_DATA,
    FIT_TRAINER_DEFAULTS,
    PLAIN_PROGRESS,
    data_keys_given,
    drop_carried_defaults,
    progress_bar,
    quiet_third_party,
    record_resolved_configs,
    trainer_group_after_esper_groups,
    with_checkpoint_io,
)
from esper.cli.resume import check_resume_fits, read_resume, resumed_run_logger
from esper.cli.summary import format_interrupt, format_summary, format_where

#: Exit status of a fit stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED_STATUS = 128 + signal.SIGINT
#: Lightning's warning when a checkpoint folder holds files (a resumed run's always does).
RESUME_FOLDER_WARNING = r"Checkpoint directory .* exists and is not empty"
#: The logger Lightning's ``seed_everything`` reports on.
SEED_LOGGER = "lightning.fabric.utilities.seed"


def fit(argv: Sequence[str] | None = None) -> int:
    """Run ``LightningCLI`` on :class:`PPOModule` and a :class:`HostDataModule`.

    ``argv`` are the arguments after ``fit``; None reads them from ``sys.argv``. Bad input
    (a config value, a data path, a checkpoint file) ends the run with one line on stderr
    naming it (``esper fit: error: model.ppo.clip_coef: must be ...``) and exit status 2,
    and leaves no run folder behind.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    from esper.callbacks import CALLBACKS
    from esper.contracts.config_errors import ConfigError
    from esper.simic.module import PPOModule, RunFailure
    from esper.tolaria.data import HostDataModule

    guard = RunFolderGuard()
    quiet_third_party()
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
            trainer_group_after_esper_groups(parser)

        def before_instantiate_classes(self) -> None:
            data = self._get(self.config, "data")
            if data is not None and data.get("class_path") != DEFAULT_DATA:
                given = sys.argv[1:] if argv is None else argv
                drop_carried_defaults(data, data_keys_given(given))

        def _parse_ckpt_path(self) -> None:
            # LightningCLI reads the file's hyperparameters into the config here, with a
            # bare torch.load; read and check it first so a bad file is named in one line.
            self._resume_from = read_resume(self.config[self.config.subcommand])
            super()._parse_ckpt_path()

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
                    f"names unknown callbacks {unknown}; allowed: {list(CALLBACKS.names())}",
                )
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:  # Lightning refuses two of one stateful callback, in a traceback
                raise ConfigError(
                    "callbacks", f"names {repeated} more than once; name each callback once"
                )
            root = Path(config.get("default_root_dir") or ".")
            try:
                try_writing_in(root)
            except OSError as exc:
                raise ConfigError(
                    "trainer.default_root_dir",
                    f"cannot write runs in {root}: {exc.strerror or exc}; pass a folder you "
                    "can write",
                ) from exc
            check_resume_fits(self._resume_from, self.model, self.datamodule)
            if self._resume_from is not None:
                # Resuming writes into the checkpoint's own folder: that it holds files is
                # the point, not something to warn about.
                warnings.filterwarnings("ignore", message=RESUME_FOLDER_WARNING)
            logger = resumed_run_logger(self._resume_from, config)
            if logger is not None:
                config["logger"] = logger
                # The folder's config.yaml is replaced by this run's (same run, resumed).
                self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}
            named = [CALLBACKS.get(name)() for name in names]
            config["plugins"] = with_checkpoint_io(config.get("plugins"))
            try:
                return super()._instantiate_trainer(
                    config, [*callbacks, *named, *progress_bar(config)]
                )
            except ConfigError:
                raise  # one of ours, keyed already
            except (MisconfigurationException, ValueError, ModuleNotFoundError) as exc:
                # What Lightning's Trainer refuses there is its arguments (a missing
                # accelerator's package included): bad input, said in one line.
                raise refused_trainer(config, exc) from exc

        def after_instantiate_classes(self) -> None:
            super().after_instantiate_classes()
            record_resolved_configs(self._get(self.config, "model"), self.model)

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
        error = None if isinstance(exc, RunFailure) else input_error(exc)
        if error is None:
            raise
        guard.remove_created()
        print(f"esper fit: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(BAD_INPUT_STATUS) from None
    except SystemExit:
        # Lightning answers Ctrl-C by tearing the run down and calling sys.exit(1); the
        # shell's convention for a run ended by SIGINT is 128 + 2.
        if started and started[0].trainer.interrupted:
            given = sys.argv[2:] if argv is None else list(argv)
            print(format_interrupt(started[0].trainer, started[0].model, given), file=sys.stderr)
            raise SystemExit(INTERRUPTED_STATUS) from None
        raise
    print(format_summary(cli.model))
    print(format_where(cli.trainer))
    return 0
