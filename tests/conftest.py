"""Shared fixtures. Every server a test starts binds 127.0.0.1 on a free port."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()
