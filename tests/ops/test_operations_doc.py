"""docs/operations.md: every YAML block is checked against the file it names or with
promtool/amtool, and every alert (the sidecar's four and each rule) has a runbook."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from saga_otel.testing import start_sidecar
from tests.ops.conftest import (
    ALERTMANAGER,
    OPERATIONS,
    REPO,
    RULES,
    SIDECAR_ALERTS,
    load_rules,
    run_tool,
    tool,
)

BLOCK_RE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)
TITLE_RE = re.compile(r'title="([^"]+)"')
RUNBOOK_SECTION = "## Runbooks"
PROBES = "saga-sidecar container: probes"


def _blocks() -> list[tuple[str, str, str]]:
    """(language, title, body) of every fenced block in operations.md."""
    out = []
    for lang, info, body in BLOCK_RE.findall(OPERATIONS.read_text(encoding="utf-8")):
        title = TITLE_RE.search(info)
        out.append((lang, title.group(1) if title else "", body))
    return out


def _yaml_blocks() -> dict[str, str]:
    return {title: body for lang, title, body in _blocks() if lang in ("yaml", "yml")}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_yaml_block_has_a_checked_title() -> None:
    blocks = [(lang, title) for lang, title, _ in _blocks() if lang in ("yaml", "yml")]
    assert blocks
    assert all(title for _, title in blocks), "every yaml block needs title=...: it is tested"
    assert {title for _, title in blocks} == {
        "prometheus.yml",
        "dashboards/provisioning/dashboards.yaml",
        "dashboards/provisioning/datasources.yaml",
        "alerts/saga-rules.yml",
        "alerts/alertmanager.example.yml",
        PROBES,
    }


def test_prometheus_config_snippet_passes_promtool(tmp_path: Path) -> None:
    config = tmp_path / "prometheus.yml"
    config.write_text(_yaml_blocks()["prometheus.yml"], encoding="utf-8")
    shutil.copy(RULES, tmp_path / "saga-rules.yml")
    result = run_tool(tool("promtool"), "check", "config", config)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert set(jobs) == {"saga-agents", "saga-sidecar"}
    assert jobs["saga-sidecar"]["static_configs"][0]["targets"] == ["127.0.0.1:4320"]


@pytest.mark.parametrize(
    "name",
    [
        "dashboards/provisioning/dashboards.yaml",
        "dashboards/provisioning/datasources.yaml",
        "alerts/alertmanager.example.yml",
    ],
)
def test_file_snippets_equal_the_files(name: str) -> None:
    assert _yaml_blocks()[name] == (REPO / name).read_text(encoding="utf-8")


def test_the_probes_snippet_asks_readyz_for_readiness_and_healthz_for_liveness(
    tmp_path: Path,
) -> None:
    """Each probe's command, run as written against a sidecar with a token (its port put
    in for 4320): it passes with the token in the environment, fails without it."""
    probes = yaml.safe_load(_yaml_blocks()[PROBES])
    assert set(probes) == {"readinessProbe", "livenessProbe"}
    token = "probe-t0ken"
    with start_sidecar(tmp_path, "--token", token) as sidecar:
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            program, flag, script = probes[probe]["exec"]["command"]
            assert (program, flag) == ("python", "-c")
            assert f"http://127.0.0.1:4320{path}" in script, probe
            script = script.replace("http://127.0.0.1:4320", sidecar.api)
            for env, passes in (({"SAGA_SIDECAR_TOKEN": token}, True), ({}, False)):
                ran = subprocess.run(
                    [sys.executable, flag, script],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                assert (ran.returncode == 0) is passes, (probe, env, ran.stderr[-500:])
                if not passes:
                    assert "401" in ran.stderr, ran.stderr[-500:]


def test_alertmanager_snippet_passes_amtool(tmp_path: Path) -> None:
    path = tmp_path / "alertmanager.yml"
    path.write_text(_yaml_blocks()[ALERTMANAGER.relative_to(REPO).as_posix()], encoding="utf-8")
    result = run_tool(tool("amtool"), "check-config", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_snippet_equals_the_rules_file() -> None:
    snippet = yaml.safe_load(_yaml_blocks()["alerts/saga-rules.yml"])
    groups = {g["name"]: g for g in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]}
    shown: list[dict[str, Any]] = [r for g in snippet["groups"] for r in g["rules"]]
    assert shown
    for group in snippet["groups"]:
        rules = {r["alert"]: r for r in groups[group["name"]]["rules"]}
        for rule in group["rules"]:
            assert rule == rules[rule["alert"]]


@pytest.mark.parametrize("name", [*SIDECAR_ALERTS, *(r["alert"] for r in load_rules())])
def test_every_alert_has_a_runbook(name: str) -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    runbooks = text[text.index(RUNBOOK_SECTION) :]
    match = re.search(rf"^#+ {name}\n(.*?)(?=^#+ |\Z)", runbooks, re.M | re.S)
    assert match, f"no runbook heading for {name}"
    assert _slug(name) == name.lower()
    body = match.group(1)
    for part in ("**Means:**", "**Look at:**", "**Do:**"):
        assert part in body, f"{name} runbook lacks {part}"


def test_internal_links_resolve() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links
    assert set(links) <= anchors


def _commands() -> list[str]:
    text = OPERATIONS.read_text(encoding="utf-8")
    return sorted(set(re.findall(r"`((?:saga-sidecar|saga-otel) [^`]+)`", text)))


@pytest.mark.parametrize("command", _commands())
def test_documented_commands_exist(command: str) -> None:
    """Each command and option named in this page is one the real CLI has."""
    import click

    from saga_otel._cli import build_parser
    from sidecar._cli import main as sidecar_main

    program, *words = shlex.split(command)
    if program == "saga-otel":  # argparse: the documented command line must parse as written
        try:
            build_parser().parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{command}: saga-otel refuses it (exit {exc.code})")
        return
    cmd: click.Command = sidecar_main
    while isinstance(cmd, click.Group) and words and words[0] in cmd.commands:
        cmd = cmd.commands[words.pop(0)]
    assert not isinstance(cmd, click.Group), f"{command}: no such subcommand"
    options = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for word in words:
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"{command}: {cmd.name} has no {word}"
