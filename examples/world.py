"""Small fakes of the world outside the agent: a ledger, a ticket system, a mail
service, a flag store, an app store and an ad mediation service.

They keep what a real backend would: a credit is reversed by appending a
reversing entry (the original stays), and writes honour idempotency keys so a
retried call converges instead of doubling an effect.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any


class ServiceDown(Exception):
    """The fake service refuses the call, as a real one does during an outage."""


@dataclass
class World:
    ledger: list[dict[str, Any]] = field(default_factory=list)
    tickets: dict[str, str] = field(default_factory=lambda: {"T-9104": "open"})
    orders: dict[int, dict[str, Any]] = field(
        default_factory=lambda: {
            4921: {"order_id": 4921, "customer": "c-77", "amount": 2500, "ticket_id": "T-9104"}
        }
    )
    outbox: list[dict[str, Any]] = field(default_factory=list)
    mail_down: bool = False
    flags: dict[str, bool] = field(default_factory=lambda: {"new_feature": False})
    metadata: dict[str, str] = field(default_factory=lambda: {"title": "Old title"})
    mediation: dict[str, Any] = field(default_factory=lambda: {"waterfall": ["a", "b"]})
    flag_down: bool = False
    ledger_down: bool = False
    _seq: Any = field(default_factory=lambda: itertools.count(9104))
    _keys: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _once(self, key: str | None, make: Any) -> Any:
        with self._lock:
            if key and key in self._keys:
                return self._keys[key]
            out = make()
            if key:
                self._keys[key] = out
            return out

    # -- ledger ----------------------------------------------------------------
    def issue_credit(self, order_id: int, amount: int, key: str | None = None) -> dict[str, Any]:
        def make() -> dict[str, Any]:
            credit_id = f"cr_{next(self._seq)}_{order_id}"
            entry = {"credit_id": credit_id, "order_id": order_id, "amount": amount}
            self.ledger.append(entry)
            return dict(entry)

        return dict(self._once(key, make))

    def reverse_credit(self, credit_id: str, key: str | None = None) -> dict[str, Any]:
        if self.ledger_down:
            raise ServiceDown("ledger unavailable (503)")

        def make() -> dict[str, Any]:
            original = next(e for e in self.ledger if e["credit_id"] == credit_id)
            entry = {
                "credit_id": f"rev_{credit_id}",
                "order_id": original["order_id"],
                "amount": -original["amount"],
                "reverses": credit_id,
            }
            self.ledger.append(entry)
            return dict(entry)

        return dict(self._once(key or f"reverse:{credit_id}", make))

    def balance(self, order_id: int) -> int:
        return sum(e["amount"] for e in self.ledger if e["order_id"] == order_id)

    # -- tickets and mail ----------------------------------------------------------
    def ticket_status(self, ticket_id: str) -> str:
        return self.tickets[ticket_id]

    def set_ticket_status(self, ticket_id: str, status: str) -> str:
        with self._lock:
            self.tickets[ticket_id] = status
        return status

    def send_reply(self, ticket_id: str, body: str, key: str | None = None) -> dict[str, Any]:
        if self.mail_down:
            raise ServiceDown("mail service unavailable (503)")

        def make() -> dict[str, Any]:
            msg = {"ticket_id": ticket_id, "body": body, "message_id": f"m-{len(self.outbox) + 1}"}
            self.outbox.append(msg)
            return dict(msg)

        return dict(self._once(key, make))
