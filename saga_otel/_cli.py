"""The ``saga-otel`` command: recover a run whose agent died."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import click

from saga_otel._errors import SagaError
from saga_otel._export import configure
from saga_otel._recovery import DEFAULT_SIDECAR_API, ENV_SIDECAR_API, recover
from saga_otel._registry import ToolRegistry
from saga_otel.records import RetryPolicy, RunStatus


def load_registry(spec: str) -> ToolRegistry:
    """``package.module:name``: a ToolRegistry, or a callable that returns one."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(
            f"{spec!r} is not MODULE:NAME; point at your agent's registry, e.g. "
            "examples.demo_tools:registry"
        )
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {spec!r}: {exc}") from exc
    if callable(obj) and not isinstance(obj, ToolRegistry):
        obj = obj()
    if not isinstance(obj, ToolRegistry):
        raise click.BadParameter(f"{spec!r} is a {type(obj).__name__}, not a ToolRegistry")
    return obj


@click.group()
def main() -> None:
    """saga-otel: compensation stacks for agents' tool calls."""


@main.command("recover")
@click.argument("run_id")
@click.option(
    "--tools",
    "tools_spec",
    required=True,
    envvar="SAGA_OTEL_TOOLS",
    show_envvar=True,
    help="The agent's ToolRegistry as MODULE:NAME (or a factory returning one).",
)
@click.option(
    "--sidecar",
    default=DEFAULT_SIDECAR_API,
    envvar=ENV_SIDECAR_API,
    show_envvar=True,
    show_default=True,
    help="The sidecar's API base URL, where the run's stack is fetched.",
)
@click.option(
    "--otlp",
    default="http://127.0.0.1:4318",
    envvar="SAGA_OTEL_SIDECAR_ENDPOINT",
    show_envvar=True,
    show_default=True,
    help="Where the recovery's own spans go (the sidecar's OTLP/HTTP endpoint).",
)
@click.option("--token", envvar="SAGA_OTEL_TOKEN", show_envvar=True, help="Bearer token.")
@click.option("--attempts", default=3, show_default=True, help="Attempts per compensation.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def recover_cmd(
    run_id: str,
    tools_spec: str,
    sidecar: str,
    otlp: str,
    token: str | None,
    attempts: int,
    as_json: bool,
) -> None:
    """Unwind RUN_ID's compensation stack, as the sidecar rebuilt it, from this process."""
    tools = load_registry(tools_spec)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    export = configure(otlp, headers=headers)
    try:
        report = recover(
            run_id,
            tools=tools,
            sidecar=sidecar,
            token=token,
            retry=RetryPolicy(attempts=attempts),
        )
    except SagaError as exc:
        click.echo(f"saga-otel: {exc}", err=True)
        sys.exit(2)
    finally:
        export.shutdown()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        done = len(report.compensations_run)
        click.echo(f"run {report.run_id}: {report.status.value} ({done} compensation(s) run)")
        for o in report.compensations:
            mark = "✓" if o.ok else "✗"
            click.echo(f"  {mark} {o.compensation.tool}({json.dumps(dict(o.compensation.args))})")
        card = report.escalation_card()
        if card is not None:
            click.echo(card.render())
    sys.exit(0 if report.status is RunStatus.COMPENSATED else 1)
