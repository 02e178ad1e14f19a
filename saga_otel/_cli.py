"""The ``saga-otel`` command: recover a run whose agent died; review an MCP server's mapping.

Built on argparse, not click: the library installs without the sidecar's
command-line stack (click, rich), and this command is small enough not to miss it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from saga_otel import __version__
from saga_otel._config import configure
from saga_otel._errors import SagaError
from saga_otel._leasing import DEFAULT_LEASE_TTL_S, MAX_LEASE_TTL_S, MIN_LEASE_TTL_S
from saga_otel._recovery import (
    CLI_HINTS,
    DEFAULT_SIDECAR_API,
    ENV_SIDECAR_API,
    NothingToRecoverError,
    RecoveryRefusedError,
    find_run_id,
    recover_with_hints,
)
from saga_otel._registry import ToolRegistry
from saga_otel._text import printable
from saga_otel.records import RetryPolicy, RunStatus, SagaReport, describe_error, exception_text

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

ENV_TOOLS = "SAGA_OTEL_TOOLS"
ENV_OTLP = "SAGA_OTEL_SIDECAR_ENDPOINT"
ENV_TOKEN = "SAGA_OTEL_TOKEN"
DEFAULT_OTLP = "http://127.0.0.1:4318"

# `saga-otel recover` exit codes (documented in docs/operations.md and --help).
EXIT_RECOVERED = 0
EXIT_FAILED = 1
EXIT_ERROR = 2  # also argparse's own code for a bad command line
EXIT_REFUSED = 3
EXIT_NOTHING_TO_DO = 4

_EXIT_CODES = f"""exit codes:
  {EXIT_RECOVERED}  recovered: every undo left on the stack ran and the sidecar acknowledged it
  {EXIT_FAILED}  failed: an undo failed; the run is compensation_failed and escalated
  {EXIT_ERROR}  error: bad input, sidecar unreachable, tools missing, past the pivot
  {EXIT_REFUSED}  refused: the run's agent is alive (or came back during the recovery), or
     another recoverer holds the lease or took it over before this one finished (even if
     its undos ran)
  {EXIT_NOTHING_TO_DO}  nothing to do: the run already finished (completed, compensated, ...)"""


class _BadTools(ValueError):
    """``--tools`` does not name a ToolRegistry; the message says what it names instead."""


def _load_object(spec: str) -> Any:
    """``package.module:name``: whatever that names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _BadTools(f"{spec!r} is not MODULE:NAME, e.g. examples.mcp_refund_agent:DECLARE")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise _BadTools(f"cannot load {spec!r}: {exception_text(exc)}") from exc


def load_registry(spec: str) -> ToolRegistry:
    """``package.module:name``: a ToolRegistry, or a callable that returns one."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _BadTools(
            f"{spec!r} is not MODULE:NAME; point at your agent's registry, e.g. "
            "examples.demo_tools:registry"
        )
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise _BadTools(f"cannot load {spec!r}: {exception_text(exc)}") from exc
    if callable(obj) and not isinstance(obj, ToolRegistry):
        try:
            obj = obj()
        except TypeError as exc:
            raise _BadTools(
                f"{spec!r} is a callable that needs arguments ({exception_text(exc)}); point at a "
                "ToolRegistry or a factory that takes none"
            ) from exc
        except SagaError as exc:  # e.g. an MCP registry whose server is down
            raise _BadTools(
                f"{spec!r} could not build the registry: {exception_text(exc)}"
            ) from exc
        except Exception as exc:  # the user's factory: its error, in one line
            raise _BadTools(f"the factory {spec!r} failed: {describe_error(exc)}") from exc
    if not isinstance(obj, ToolRegistry):
        raise _BadTools(f"{spec!r} is a {type(obj).__name__}, not a ToolRegistry")
    return obj


def _env_help(text: str, env: str, default: object = None) -> str:
    shown = f"; default: {default}" if default is not None else ""
    return f"{text} [env: {env}{shown}]"


def _lease_ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_LEASE_TTL_S <= value <= MAX_LEASE_TTL_S:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds in {MIN_LEASE_TTL_S:g}..{MAX_LEASE_TTL_S:g}"
        )
    return value


# argparse takes a word that begins with '-' for an option; after '--' it is the id.
_DASHED_ID = (
    "a run id that begins with '-' goes last, after '--': "
    "saga-otel recover --tools MODULE:NAME -- -RUN"
)


def _shown(text: str) -> str:
    """``text`` with each line :func:`printable`: every line this command prints passes
    here. Outside text reaches it (a lease holder's name, the agent's tool names, the
    sidecar's errors): shown with escapes, never obeyed by the terminal."""
    return "\n".join(printable(line) for line in text.split("\n"))


def _say(text: str, *, err: bool = False) -> None:
    print(_shown(text), file=sys.stderr if err else sys.stdout)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line naming the fix (``-h`` shows the whole usage)."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse's one writer: usage, help, --version and errors.
        if message:
            (file or sys.stderr).write(_shown(message))

    def error(self, message: str) -> NoReturn:
        if "RUN_ID" in message:  # often an id that begins with '-', taken for an option
            message = f"{message}; {_DASHED_ID}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; defaults read the environment when it is built."""
    parser = _Parser(
        prog="saga-otel", description="saga-otel: compensation stacks for agents' tool calls."
    )
    parser.add_argument("--version", action="version", version=f"saga-otel {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
    rec = commands.add_parser(
        "recover",
        help="unwind a dead agent's run from this process",
        description="Unwind RUN_ID's compensation stack, as the sidecar rebuilt it, "
        "from this process. It first takes the run's recovery lease from the sidecar: "
        "refused while the run's agent is alive or another recoverer holds it.",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rec.add_argument(
        "run_id",
        metavar="RUN_ID",
        help=f"The run's id, or any unique prefix of it ({_DASHED_ID}).",
    )
    rec.add_argument(
        "--tools",
        dest="tools_spec",
        metavar="MODULE:NAME",
        default=os.environ.get(ENV_TOOLS),
        help=_env_help(
            "The agent's ToolRegistry as MODULE:NAME (or a factory returning one).", ENV_TOOLS
        ),
    )
    rec.add_argument(
        "--sidecar",
        metavar="URL",
        default=os.environ.get(ENV_SIDECAR_API, DEFAULT_SIDECAR_API),
        help=_env_help(
            "The sidecar's API base URL, where the run's stack is fetched.",
            ENV_SIDECAR_API,
            DEFAULT_SIDECAR_API,
        ),
    )
    rec.add_argument(
        "--otlp",
        metavar="URL",
        default=os.environ.get(ENV_OTLP, DEFAULT_OTLP),
        help=_env_help(
            "Where the recovery's own spans go (the sidecar's OTLP/HTTP endpoint).",
            ENV_OTLP,
            DEFAULT_OTLP,
        ),
    )
    rec.add_argument(
        "--token", default=os.environ.get(ENV_TOKEN), help=_env_help("Bearer token.", ENV_TOKEN)
    )
    rec.add_argument(
        "--attempts", type=int, default=3, help="Attempts per compensation (default: 3)."
    )
    rec.add_argument(
        "--force",
        action="store_true",
        help="Recover although the sidecar believes the run's agent is alive (needs --reason).",
    )
    rec.add_argument(
        "--reason",
        help="Why forcing is right; recorded on the run, shown by `saga-sidecar runs show` "
        "and the alert card.",
    )
    rec.add_argument(
        "--lease-ttl",
        type=_lease_ttl,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="Seconds the recovery lease lasts unless renewed; it is renewed while working "
        f"(default: {DEFAULT_LEASE_TTL_S:g}).",
    )
    rec.add_argument(
        "--json", dest="as_json", action="store_true", help="Print the report as JSON."
    )
    rec.set_defaults(command_parser=rec)  # so main() reports errors with recover's usage
    tools = commands.add_parser(
        "mcp-tools",
        help="print each MCP tool's step class and undo, for review before an agent runs",
        description="Start SERVER_COMMAND as an MCP server over stdio and print the step class, "
        "pivot and undo the MCP adapter gives each of its tools (needs saga-otel[mcp]). "
        "Exit status 1 when a tool is unclassified (the agent would refuse to start).",
    )
    tools.add_argument(
        "--declare",
        metavar="MODULE:NAME",
        help="The agent's declarations: a dict of tool name to saga_otel.adapters.mcp.Declare "
        "(or a factory returning one).",
    )
    tools.add_argument(
        "--unannotated",
        choices=("refuse", "irreversible"),
        default="refuse",
        help="What a tool with no annotations and no declaration becomes (default: refuse).",
    )
    tools.add_argument(
        "server", nargs=argparse.REMAINDER, metavar="SERVER_COMMAND",
        help="The server's command line, e.g. python -m examples.mcp_refund_server.",
    )  # fmt: skip
    tools.set_defaults(command_parser=tools)
    return parser


def _mcp_tools(args: argparse.Namespace) -> int:
    """``saga-otel mcp-tools``: the review table on stdout; 1 if a tool is unclassified."""
    import asyncio

    parser: argparse.ArgumentParser = args.command_parser
    server = list(args.server)
    if server[:1] == ["--"]:
        server = server[1:]
    if not server:
        parser.error("give the MCP server's command, e.g. python -m examples.mcp_refund_server")
    try:
        from saga_otel.adapters import mcp as adapter
    except ImportError as exc:
        _say(f"saga-otel: {exception_text(exc)}", err=True)
        return 2
    declare: Any = None
    if args.declare:
        try:
            declare = _load_object(args.declare)
        except _BadTools as exc:
            parser.error(f"--declare: {exception_text(exc)}")
        if callable(declare):
            declare = declare()
        if not isinstance(declare, dict) or not all(
            isinstance(v, adapter.Declare) for v in declare.values()
        ):
            parser.error(f"--declare: {args.declare!r} is not a dict of tool name to Declare")
    try:
        rows, refusal = asyncio.run(
            adapter.review_command(server, declare, unannotated=args.unannotated)
        )
    except Exception as exc:  # the server did not start or speak MCP: one line, not a trace
        _say(f"saga-otel: {_mcp_failure(server, exc)}", err=True)
        return 2
    _say(adapter.review(rows))
    if refusal is not None:
        _say(f"saga-otel: {refusal}", err=True)
        return 1
    return 0


def _mcp_failure(server: Sequence[str], exc: Exception) -> str:
    """One line for a failed ``mcp-tools`` listing: the first error inside the MCP
    client's task groups (whose own text, "unhandled errors in a TaskGroup", names
    none), and for a server that started, what to do next."""
    leaf: BaseException = exc
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
        leaf = leaf.exceptions[0]
    if isinstance(leaf, SagaError):  # ours (e.g. a tools/list that never ends): it says the fix
        return " ".join(exception_text(leaf).split())
    text = f"cannot list the tools of {' '.join(server)!r}: {describe_error(leaf)}"
    if not isinstance(leaf, FileNotFoundError | PermissionError):  # it did start
        text += (
            "; the server exited or does not speak MCP on stdio: run the command alone to "
            "see its error"
        )
    return " ".join(text.split())  # one line, whatever the error's text holds


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``saga-otel``.

    ``recover``: the ``EXIT_*`` codes (``saga-otel recover -h``). ``mcp-tools``: 0 when
    every tool is classified, 1 when one is not, 2 on errors.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "mcp-tools":
        return _mcp_tools(args)
    rec: argparse.ArgumentParser = args.command_parser
    if not args.tools_spec:
        rec.error(f"--tools is required (or set {ENV_TOOLS}), e.g. examples.demo_tools:registry")
    try:
        tools = load_registry(args.tools_spec)
    except _BadTools as exc:
        rec.error(f"--tools: {exception_text(exc)}")
    if args.force and not (args.reason or "").strip():
        rec.error("--force needs --reason '...': say why; it is recorded on the run")
    token: str | None = args.token
    headers = {"Authorization": f"Bearer {token}"} if token else None
    export = configure(args.otlp, headers=headers)
    run_id = args.run_id
    try:
        # Any unique prefix of the id, as `saga-sidecar runs list` prints it.
        run_id = find_run_id(args.run_id, args.sidecar, token=token, cli=True)
        report = recover_with_hints(
            run_id,
            tools=tools,
            sidecar=args.sidecar,
            token=token,
            retry=RetryPolicy(attempts=args.attempts),
            tracer_provider=None,
            registry=None,
            logger=None,
            view=None,
            force=args.force,
            reason=args.reason,
            lease_ttl=args.lease_ttl,
            holder=None,
            hints=CLI_HINTS,
        )
    except NothingToRecoverError as exc:
        if args.as_json:
            outcome = {"run_id": run_id, "outcome": "nothing_to_do", "status": exc.status}
            _say(json.dumps({**outcome, "message": exception_text(exc)}))
        else:
            _say(f"saga-otel: {exception_text(exc)}")
        return EXIT_NOTHING_TO_DO
    except RecoveryRefusedError as exc:
        _say(f"saga-otel: {exception_text(exc)}", err=True)
        return EXIT_REFUSED
    except SagaError as exc:
        _say(f"saga-otel: {exception_text(exc)}", err=True)
        return EXIT_ERROR
    finally:
        export.shutdown()
    if args.as_json:
        _say(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        _say(report_text(report))
    return EXIT_RECOVERED if report.status is RunStatus.COMPENSATED else EXIT_FAILED


def report_text(report: SagaReport) -> str:
    """A recovery's outcome for the terminal. The card quotes what the agent sent (its
    undos' descriptions) and what the undos raised: shown with escapes, never obeyed."""
    done = len(report.compensations_run)
    verdict = "recovered" if report.status is RunStatus.COMPENSATED else report.status.value
    ran = f"{done} compensation{'' if done == 1 else 's'} run"
    lines = [f"run {report.run_id}: {verdict} ({ran})"]
    for o in report.compensations:
        mark = "✓" if o.ok else "✗"
        lines.append(f"  {mark} {o.compensation.tool}({json.dumps(dict(o.compensation.args))})")
    card = report.escalation_card()
    if card is not None:
        lines.extend(card.render().splitlines())
    return "\n".join(printable(line) for line in lines)
