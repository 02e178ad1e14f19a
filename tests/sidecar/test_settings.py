"""Settings validation: unsafe binds are refused before anything listens."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from sidecar import ConfigError, Settings
from sidecar._cli import main
from sidecar._settings import default_db_path, parse_duration, parse_size


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "sidecar.example.com"])
def test_non_loopback_host_without_token_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="--token"):
        Settings(host=host)


def test_non_loopback_host_with_token_is_allowed() -> None:
    assert Settings(host="0.0.0.0", token="abc123").host == "0.0.0.0"


def test_loopback_hosts_need_no_token() -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert Settings(host=host).token is None


def test_cli_refuses_public_bind_with_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--host", "0.0.0.0", "--db", str(tmp_path / "x.db")]
    )
    assert result.exit_code != 0
    assert "refusing to listen on non-loopback host '0.0.0.0'" in result.output
    assert not (tmp_path / "x.db").exists()


def test_env_vars_are_shown_and_read(tmp_path: Path) -> None:
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for name in (
        "SAGA_SIDECAR_HOST",
        "SAGA_SIDECAR_API_PORT",
        "SAGA_SIDECAR_OTLP_HTTP_PORT",
        "SAGA_SIDECAR_OTLP_GRPC_PORT",
        "SAGA_SIDECAR_DB",
        "SAGA_SIDECAR_TOKEN",
        "SAGA_SIDECAR_FORWARD",
        "SAGA_SIDECAR_RETENTION",
        "SAGA_SIDECAR_IDLE_TIMEOUT",
        "SAGA_SIDECAR_MAX_BODY",
    ):
        assert name in help_text
    result = CliRunner().invoke(
        main, ["serve", "--db", str(tmp_path / "x.db")], env={"SAGA_SIDECAR_HOST": "10.0.0.1"}
    )
    assert result.exit_code != 0 and "'10.0.0.1'" in result.output


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"api_port": 70000}, "api_port"),
        ({"token": "has space", "host": "0.0.0.0"}, "whitespace"),
        ({"forward": "collector:4318"}, "--forward"),
        ({"max_body": 0}, "max_body"),
        ({"idle_timeout": 0}, "idle_timeout"),
    ],
)
def test_bad_settings_name_the_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_durations_and_sizes() -> None:
    assert parse_duration("7d", "x") == 7 * 86400
    assert parse_duration("250ms", "x") == 0.25
    assert parse_duration("90", "x") == 90
    assert parse_size("16MiB", "x") == 16 * 1024 * 1024
    assert parse_size("512", "x") == 512
    with pytest.raises(ConfigError, match="duration"):
        parse_duration("soon", "--retention")
    with pytest.raises(ConfigError, match="size"):
        parse_size("big", "--max-body")


def test_default_db_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "saga-sidecar" / "sidecar.db"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_db_path() == Path.home() / ".local/state/saga-sidecar/sidecar.db"


def test_slow_client_limits_are_flags_with_env_vars_and_are_validated(tmp_path: Path) -> None:
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for flag, env in (
        ("--body-timeout", "SAGA_SIDECAR_BODY_TIMEOUT"),
        ("--body-min-rate", "SAGA_SIDECAR_BODY_MIN_RATE"),
        ("--max-receiving", "SAGA_SIDECAR_MAX_RECEIVING"),
        ("--keepalive-timeout", "SAGA_SIDECAR_KEEPALIVE_TIMEOUT"),
        ("--max-connections", "SAGA_SIDECAR_MAX_CONNECTIONS"),
    ):
        assert flag in help_text and env in help_text
    result = CliRunner().invoke(
        main,
        ["serve", "--db", str(tmp_path / "x.db")],
        env={"SAGA_SIDECAR_BODY_TIMEOUT": "soon"},
    )
    assert result.exit_code != 0 and "--body-timeout 'soon' is not a duration" in result.output
    with pytest.raises(ConfigError, match="max_receiving=0 must be >= 1"):
        Settings(max_receiving=0)
    with pytest.raises(ConfigError, match="body_timeout=0"):
        Settings(body_timeout=0)
    with pytest.raises(ConfigError, match="keepalive_timeout=0"):
        Settings(keepalive_timeout=0)
    with pytest.raises(ConfigError, match="max_connections=0 must be >= 1"):
        Settings(max_connections=0)


def test_late_compensation_alerts_flag_and_env() -> None:
    import click

    from sidecar._alert_settings import AlertSettings, alert_options, settings_from_options

    got: list[AlertSettings] = []

    @click.command()
    @alert_options
    def cmd(**options: object) -> None:
        got.append(settings_from_options(dict(options)))

    runner = CliRunner()
    assert runner.invoke(cmd, []).exit_code == 0
    assert runner.invoke(cmd, ["--no-late-compensation-alerts"]).exit_code == 0
    env = {"SAGA_SIDECAR_LATE_COMPENSATION_ALERTS": "false"}
    assert runner.invoke(cmd, [], env=env).exit_code == 0
    assert [s.late_compensation for s in got] == [True, False, False]
    assert [s.rule_config().late_compensation for s in got] == [True, False, False]


@pytest.mark.parametrize(
    ("flag", "kwargs"),
    [
        ("--webhook", {"webhook_urls": ("http://127.0.0.1:99999/hook",)}),
        ("--alertmanager", {"alertmanager_urls": ("http://",)}),
        ("--pagerduty-url", {"pagerduty_routing_key": "k", "pagerduty_url": "https://:443/x"}),
    ],
)
def test_a_sink_url_that_names_no_host_is_refused_at_start(
    flag: str, kwargs: dict[str, object]
) -> None:
    """aiohttp cannot send to it: every alert to that sink would wait in the outbox,
    retried, until someone saw the backlog. It is refused at start, naming its flag."""
    from sidecar._alert_settings import AlertSettings

    with pytest.raises(ConfigError, match=f"^{flag} .* names no host"):
        AlertSettings(**kwargs)  # type: ignore[arg-type]


def test_cli_refuses_a_sink_url_with_a_bad_port_in_one_line(tmp_path: Path) -> None:
    hook = "http://127.0.0.1:99999/hook"
    args = ["serve", "--db", str(tmp_path / "s.db"), "--webhook", hook]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert f"--webhook '{hook}' names no host (or a bad port)" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pagerduty_routing_key": ""}, r"^--pagerduty-routing-key is empty \(an unset variable"),
        ({"pagerduty_routing_key": " "}, r"^--pagerduty-routing-key is empty"),
        (
            {"pagerduty_url": "http://127.0.0.1:9/v2/enqueue"},
            r"^--pagerduty-url 'http://127.0.0.1:9/v2/enqueue' is given without "
            r"--pagerduty-routing-key, so PagerDuty would be off: give the key too",
        ),
    ],
)
def test_a_pagerduty_sink_half_configured_is_refused_at_start(
    kwargs: dict[str, object], message: str
) -> None:
    """An empty key (`--pagerduty-routing-key=$PD_KEY`, the variable unset) or a URL with
    no key turned PagerDuty off without a word: critical pages went nowhere."""
    from sidecar._alert_settings import AlertSettings

    with pytest.raises(ConfigError, match=message):
        AlertSettings(**kwargs)  # type: ignore[arg-type]
    assert AlertSettings(**{**kwargs, "pagerduty_routing_key": "k"})  # type: ignore[arg-type]


def test_cli_refuses_an_empty_pagerduty_routing_key_in_one_line(tmp_path: Path) -> None:
    args = ["serve", "--db", str(tmp_path / "s.db"), "--pagerduty-routing-key="]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert "--pagerduty-routing-key is empty" in result.output
    assert "Traceback" not in result.output


def test_cli_refuses_an_alert_retry_max_below_the_first_retry_naming_the_flag(
    tmp_path: Path,
) -> None:
    # It said `Backoff(initial=0.5, ..., maximum=0.2, ...): need initial > 0, ...`.
    args = ["serve", "--db", str(tmp_path / "s.db"), "--alert-retry-max", "0.2s"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert (
        "--alert-retry-max 0.2s is shorter than the first retry's wait (0.5s): give at "
        "least 0.5s" in result.output
    )
    assert "Backoff(" not in result.output and "Traceback" not in result.output


def test_ready_stall_is_a_flag_with_an_env_var_checked_at_start(tmp_path: Path) -> None:
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--ready-stall" in help_text and "SAGA_SIDECAR_READY_STALL" in help_text
    assert "SAGA_SIDECAR_READY_STALL; default: 5s]" in " ".join(help_text.split())
    for given, told in (("soon", "is not a duration"), ("0", "must be positive")):
        result = CliRunner().invoke(
            main,
            ["serve", "--db", str(tmp_path / "x.db")],
            env={"SAGA_SIDECAR_READY_STALL": given},
        )
        assert result.exit_code != 0 and f"--ready-stall {given!r} {told}" in result.output
    assert not (tmp_path / "x.db").exists()
    assert Settings(ready_stall=0.25).ready_stall == 0.25
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"ready_stall=.* \(--ready-stall\) must be a finite"):
            Settings(ready_stall=bad)
