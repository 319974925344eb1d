"""What ``esper fit`` prints when it ends: the last rollout's figures, and after Ctrl-C the
command that resumes the run."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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


def format_where(trainer: Any) -> str:
    """Where a finished ``esper fit`` left its results, and the command that evaluates them."""
    from esper.callbacks.checkpoint import newest_checkpoint

    run_dir = Path(trainer.log_dir or trainer.default_root_dir).absolute()
    lines = [f"run folder: {run_dir} (tensorboard --logdir {run_dir.parent})"]
    saved = newest_checkpoint(trainer)
    if saved is not None and saved.is_file():
        lines += _checkpoint_and_next(saved, "evaluate", ["esper", "evaluate", "--ckpt"])
    return "\n".join(lines)


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
    lines += _checkpoint_and_next(saved, "resume", ["esper", "fit", *kept, "--ckpt_path"])
    return "\n".join(lines)


def _checkpoint_and_next(saved: Path, verb: str, command: list[str]) -> list[str]:
    """The lines naming the last checkpoint and the command (ending in it) to go on with."""
    return [f"last checkpoint: {saved}", f"{verb} with:", "  " + shlex.join([*command, str(saved)])]


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
