"""Event-loop introspection every service exports: the number of live asyncio tasks, for leak hunting (soak runs).

`start_task_gauge(registry)` registers `octoserve_asyncio_tasks` in the service's registry and keeps it current
from a background task (once a second, on the loop itself, so it never races the loop). A registry that already
has the gauge (several in-process services sharing the default registry in a test) is left as it is.
"""

from __future__ import annotations

import asyncio

import prometheus_client as prom

TASK_GAUGE = "octoserve_asyncio_tasks"
INTERVAL_S = 1.0


def start_task_gauge(registry: prom.CollectorRegistry) -> asyncio.Task | None:
    try:
        gauge = prom.Gauge(TASK_GAUGE, "live asyncio tasks in this service's event loop", registry=registry)
    except ValueError:  # already registered by another service in this process
        return None
    return asyncio.create_task(_update(gauge), name="task-gauge")


async def _update(gauge: prom.Gauge) -> None:
    while True:
        gauge.set(len(asyncio.all_tasks()))
        await asyncio.sleep(INTERVAL_S)
