"""The `fewbits` command line: a thin layer over the library.

Subcommands are loaded lazily from the table below so that `fewbits plan` (pure Python) answers
without importing torch.  Add a command by adding a line to COMMANDS.
"""

from __future__ import annotations

import importlib

import click

#: command name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "formats": "fewbits.cli.formats:formats",
    "layer-error": "fewbits.cli.layer_error:layer_error",
    "plan": "fewbits.cli.plan:plan_cmd",
    "try": "fewbits.cli.try_:try_cmd",
    "quantize": "fewbits.cli.quantize:quantize_cmd",
    "eval": "fewbits.cli.eval:eval_cmd",
    "demo": "fewbits.cli.demo:demo_cmd",
    "models": "fewbits.cli.models:models",
    "probe": "fewbits.cli.probe:probe_cmd",
    "bench": "fewbits.cli.bench:bench_cmd",
    "generate": "fewbits.cli.generate:generate_cmd",
    "ui": "fewbits.cli.ui:ui_cmd",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fewbits")
def main() -> None:
    """fewbits: how few bits can I use, what will it cost in quality, and how much faster will decode get?"""


__all__ = ["main", "COMMANDS"]
