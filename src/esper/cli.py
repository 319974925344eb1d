"""The ``esper`` command.

``esper plugins`` lists what the registries hold after loading entry points: a plugin
author's first check that their package is seen, and where each name comes from.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from esper import __version__


def _plugins(_: argparse.Namespace) -> int:
    # Imported here so `esper --help` stays fast: these pull in torch and Lightning.
    from esper.callbacks import CALLBACKS
    from esper.kasmina import BLUEPRINTS, HOSTS
    from esper.plugins import Registry
    from esper.tolaria.data import DATAMODULES

    registries: tuple[Registry[object], ...] = (BLUEPRINTS, HOSTS, DATAMODULES, CALLBACKS)  # type: ignore[assignment]
    for registry in registries:
        print(f"{registry.kind}s (entry-point group {registry.group}):")
        names = registry.names()
        if not names:
            print("  (none)")
        for name in names:
            print(f"  {name:<14} {registry.entry(name).source}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="esper", description="Train networks that grow, steered by a PPO policy."
    )
    parser.add_argument("--version", action="version", version=f"esper {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    plugins = commands.add_parser("plugins", help="list blueprints, hosts, data and callbacks")
    plugins.set_defaults(run=_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
