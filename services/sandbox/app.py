"""The sandbox service: isolated workspaces and the agent's tools, over the bus.

`sandbox.create` is served by the queue group of all replicas; a session then lives on the replica
that created it, which serves its calls on `sandbox.<replica>.<verb>`.
"""

from __future__ import annotations

import nats.errors

from crucible.contracts import endpoints
from crucible.runtime import Runtime
from services.sandbox.handlers import Handlers
from services.sandbox.leases import Leases
from services.sandbox.manager import SessionManager
from services.sandbox.metrics import SESSIONS
from services.sandbox.settings import Settings


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    manager = SessionManager(
        settings=settings, fetch=rt.store.get_bytes, leases=Leases(rt.redis, replica=settings.replica)
    )
    await manager.start()
    SESSIONS.set_function(lambda: len(manager.sessions))
    handlers = Handlers(manager=manager)
    subscriptions = [
        await rt.bus.serve(endpoints.SANDBOX_CREATE, handlers.create),
        await rt.bus.serve(endpoints.SANDBOX_LIMITS, handlers.limits),
    ]
    # A session's calls run one at a time: its replica never needs more at once than it holds sessions.
    per_session = max(settings.max_sessions, settings.serve_concurrency)
    for endpoint, handler in handlers.routes().items():
        served = await rt.bus.serve(endpoint.on(settings.replica), handler, concurrency=per_session)
        subscriptions.append(served)
    rt.spawn(manager.reap_loop(rt.stopping), name="sandbox-reaper")

    async def close() -> None:
        for subscription in subscriptions:
            try:
                await subscription.unsubscribe()
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                pass
        await manager.close()

    rt.on_close(close)
    rt.log.info("sandbox serving", replica=settings.replica, max_sessions=settings.max_sessions)
