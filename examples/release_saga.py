"""The release saga: a fixed plan, easy-to-undo steps first, the pivot last.

Mediation config and store metadata are read before they are written, so each
undo restores the exact value it replaced; the metadata is validated up front,
so a rejection changes nothing; lighting the feature flag is the pivot.
Run it: ``python -m examples.release_saga [--bad-metadata] [--flag-down]``.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

from examples.world import ServiceDown, World
from saga_otel import Saga, SagaReport, Step, configure

BANNED = ("free money",)
TITLE_LIMIT = 30


class MetadataRejected(Exception):
    """The store would reject this metadata."""


@dataclass
class Release:
    world: World
    new_mediation: dict[str, Any]
    new_title: str
    snapshots: dict[str, Any] = field(default_factory=dict)


def validate_metadata(ctx: Release) -> None:
    if len(ctx.new_title) > TITLE_LIMIT:
        raise MetadataRejected(
            f"title is {len(ctx.new_title)} characters, over the limit of {TITLE_LIMIT}"
        )
    if any(word in ctx.new_title.lower() for word in BANNED):
        raise MetadataRejected(f"title {ctx.new_title!r} contains a banned phrase")


async def update_mediation(ctx: Release) -> None:
    ctx.snapshots["mediation"] = dict(ctx.world.mediation)  # read before the write
    ctx.world.mediation = dict(ctx.new_mediation)


async def restore_mediation(ctx: Release) -> None:
    ctx.world.mediation = dict(ctx.snapshots["mediation"])


async def update_metadata(ctx: Release) -> None:
    ctx.snapshots["metadata"] = dict(ctx.world.metadata)
    ctx.world.metadata = {**ctx.world.metadata, "title": ctx.new_title}


async def restore_metadata(ctx: Release) -> None:
    ctx.world.metadata = dict(ctx.snapshots["metadata"])


async def light_flag(ctx: Release) -> None:
    if ctx.world.flag_down:
        raise ServiceDown("remote config unavailable (503)")
    ctx.world.flags["new_feature"] = True


RELEASE_STEPS = [
    Step(
        "admob_mediation",
        do=update_mediation,
        compensate=restore_mediation,
        step_class="reversible",
    ),
    Step(
        "appstore_metadata",
        do=update_metadata,
        compensate=restore_metadata,
        validate=validate_metadata,
        step_class="reversible",
    ),
    Step("remote_config_flag", do=light_flag, pivot=True),
]


async def release(saga: Saga, ctx: Release) -> SagaReport:
    return await saga.execute(RELEASE_STEPS, ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bad-metadata", action="store_true")
    parser.add_argument("--flag-down", action="store_true")
    ns = parser.parse_args()
    world = World(flag_down=ns.flag_down)
    title = "FREE MONEY inside" if ns.bad_metadata else "New title"
    ctx = Release(world, {"waterfall": ["c"]}, title)
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, when set, names the sidecar
    try:
        report = asyncio.run(release(Saga("release"), ctx))
    finally:
        export.shutdown()
    print(f"release {report.run_id}: {report.status.value}")
    print("mediation:", world.mediation, "metadata:", world.metadata, "flags:", world.flags)


if __name__ == "__main__":
    main()
