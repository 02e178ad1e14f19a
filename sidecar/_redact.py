"""Masking of secret tool arguments in everything an alert sends off the machine.

Arguments live under ``args`` keys (a compensation's captured references, the
stack). Inside them, any key named exactly as configured, or matching a
configured regular expression (``re.search`` on the key), has its value
replaced by ``***``, however deeply nested. Text such as an escalation card
line can quote arguments too, so every string value found under a masked key
(4 characters or more, to avoid masking common short words) is also masked
wherever it occurs in any string of the payload. JSON text (an annotation that
holds the stack) is parsed, masked and written back.

The database keeps the real values: recovery needs them. Alerts are masked
once, when the rules raise them (with the secrets of the whole run view, so an
argument of a compensation that succeeded is masked in a card that quotes it
too), and again by each sink; API views are masked unless the caller asks for
the real arguments with ``?reveal=args`` (docs/alerting.md, "Redaction").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from . import _jsontext as jsontext
from ._errors import ConfigError

MASK: Final = "***"
ARGS_KEY: Final = "args"
_MIN_TEXT_SECRET: Final = 4


@dataclass(frozen=True, slots=True)
class Redactor:
    keys: frozenset[str] = frozenset()
    patterns: tuple[re.Pattern[str], ...] = ()

    @classmethod
    def build(cls, keys: Iterable[str] = (), patterns: Iterable[str] = ()) -> Redactor:
        compiled = []
        for text in patterns:
            try:
                compiled.append(re.compile(text))
            except re.error as exc:
                raise ConfigError(
                    f"--redact-pattern {text!r} is not a regular expression ({exc}): "
                    r"write e.g. '(?i)token|secret|password'"
                ) from exc
        return cls(keys=frozenset(keys), patterns=tuple(compiled))

    @property
    def active(self) -> bool:
        return bool(self.keys or self.patterns)

    def secret_key(self, key: str) -> bool:
        return key in self.keys or any(p.search(key) for p in self.patterns)

    # --- collection -----------------------------------------------------------

    def secrets_in(self, *objs: Any) -> frozenset[str]:
        """Text of every value held under a secret key inside ``args``, in ``objs``."""
        found: set[str] = set()
        for obj in objs:
            self._gather(obj, False, found)
        return frozenset(s for s in found if len(s) >= _MIN_TEXT_SECRET)

    # --- masking ----------------------------------------------------------------

    def redact(self, obj: Any, extra_secrets: Iterable[str] = ()) -> Any:
        """A masked copy of ``obj``; ``extra_secrets`` are masked in text too (see module doc)."""
        if not self.active:
            return obj
        found: set[str] = set(extra_secrets)
        self._gather(obj, False, found)
        secrets = sorted((s for s in found if len(s) >= _MIN_TEXT_SECRET), key=len, reverse=True)
        return self._masked(obj, False, secrets)

    def _gather(self, obj: Any, in_args: bool, found: set[str]) -> None:
        """Collect into ``found`` what :meth:`_masked` masks under secret keys (no copies:
        the alert path runs this over two whole run views per change)."""
        if isinstance(obj, dict):
            for key, value in obj.items():
                key_text = str(key)
                if in_args and self.secret_key(key_text):
                    self._collect(value, found)
                else:
                    self._gather(value, in_args or key_text == ARGS_KEY, found)
        elif isinstance(obj, list | tuple):
            for value in obj:
                self._gather(value, in_args, found)
        elif isinstance(obj, str):
            parsed = _json_container(obj)
            if parsed is not None:
                self._gather(parsed, in_args, found)

    def _masked(self, obj: Any, in_args: bool, secrets: list[str]) -> Any:
        """A copy of ``obj`` with values under secret keys and ``secrets`` in text masked."""
        if isinstance(obj, dict):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                key_text = str(key)
                if in_args and self.secret_key(key_text):
                    out[key] = MASK
                else:
                    out[key] = self._masked(value, in_args or key_text == ARGS_KEY, secrets)
            return out
        if isinstance(obj, list | tuple):
            return [self._masked(v, in_args, secrets) for v in obj]
        if isinstance(obj, str):
            parsed = _json_container(obj)
            if parsed is not None:
                return json.dumps(self._masked(parsed, in_args, secrets), sort_keys=True)
            for secret in secrets:
                obj = obj.replace(secret, MASK)
            return obj
        return obj

    def _collect(self, value: Any, found: set[str]) -> None:
        if isinstance(value, dict):
            for v in value.values():
                self._collect(v, found)
        elif isinstance(value, list | tuple):
            for v in value:
                self._collect(v, found)
        elif isinstance(value, str):
            found.add(value)
            # A JSON-quoted copy of the value appears in text that quotes the args.
            found.add(json.dumps(value)[1:-1])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.add(str(value))


def _json_container(text: str) -> Any:
    stripped = text.lstrip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        value = jsontext.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict | list) else None
