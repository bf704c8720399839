"""Commands that list what is installed: plugins, distributions, sandboxes, filters, writers..."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import click

from ..run import distributions as dist_module
from ..contract.plugins import KINDS, Kind, describe_plugins


def _registry(distribution_file=None):
    from . import plugin_manager

    registry = plugin_manager().registry()
    if distribution_file is not None:
        for dist in dist_module.load_distribution_file(Path(distribution_file)):
            registry.add("distributions", dist, f"file {distribution_file}")
    return registry


def print_distributions(distribution_file=None, as_json: bool = False) -> None:
    registry = _registry(distribution_file)
    dists = [reg.obj for reg in registry.items("distributions")]
    available = set(registry.names("toolsets"))
    if as_json:
        click.echo(json.dumps(dist_module.distributions_as_json(dists, available), indent=2))
    else:
        click.echo(dist_module.format_distributions(dists, available))


@click.command("distributions")
@click.option("--distribution_file", "--distribution-file", type=click.Path(dir_okay=False), help="Also list the distributions of this TOML or JSON file.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def distributions_command(distribution_file, as_json):
    """List the toolset distributions with each toolset's probability."""
    print_distributions(distribution_file, as_json)


@click.command("plugins")
def plugins_command():
    """List installed plugins and what each provides, as JSON."""
    from . import plugin_manager

    click.echo(json.dumps(describe_plugins(plugin_manager()), indent=2))


def _listing(kind: Kind) -> click.Command:
    what = f"{kind.plural} ({kind.option})" if kind.option else kind.plural

    @click.command(kind.listing, help=f"List the installed {what}.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    def command(as_json):
        registry = _registry()
        rows = []
        for reg in registry.items(kind.key):
            # a name two plugins register is listed by its qualified names, which select it
            name = reg.qualified if reg.name in registry.clashes[kind.key] else reg.name
            row = {"name": name, "qualified": reg.qualified, "plugin": reg.plugin,
                   "description": getattr(reg.obj, "description", "")}
            if kind.key == "toolsets":
                row["tools"] = [t.name for t in reg.obj.tools]
                row["options"] = [f.name for f in attrs.fields(reg.obj.Config)]
            rows.append(row)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        width = max((len(r["name"]) for r in rows), default=0)
        for row in rows:
            extra = f" [{', '.join(row['tools'])}]" if "tools" in row else ""
            if row.get("options"):
                extra += f" -T {row['name']}.{{{','.join(row['options'])}}}"
            click.echo(f"{row['name']:<{width}}  {row['description']}{extra}  (from {row['plugin']})")

    return command


def listing_commands() -> list[click.Command]:
    """A listing command for each kind of plugin object that has one (see ``KINDS``)."""
    return [_listing(kind) for kind in KINDS if kind.listing]
