"""BALLAST_ADMIN_PORT: /admin answers only on its own listener, and that listener answers
nothing else of /v1 than usage and limits (which serve admin keys too), beside the console;
over real sockets, as `ballast api` listens."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn

from ballast.procs import listen_nodelay
from tests.api.conftest import Untouchable, assert_openai_error, build, new_key


async def test_admin_only_on_its_own_listener(settings, db, default_key):
    public, private = listen_nodelay("127.0.0.1", 0), listen_nodelay("127.0.0.1", 0)
    admin_port = private.getsockname()[1]
    split = settings.model_copy(update=dict(admin_port=admin_port))
    app = build(split, db, Untouchable("temporal"), None)._transport.app
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[public, private]))
    while not server.started:
        await asyncio.sleep(0.01)
    admin = {"Authorization": f"Bearer {await new_key(db, None, admin=True)}"}
    tenant = {"Authorization": f"Bearer {default_key}"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{public.getsockname()[1]}") as outside, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}") as inside:
            # The public listener: /admin is no route there, with whatever key.
            for headers in (admin, tenant, {}):
                assert_openai_error(await outside.get("/admin/tenants", headers=headers), 404, code="not_found")
            assert (await outside.get("/v1/models", headers=tenant)).status_code == 200
            # The admin listener: /admin, and nothing of /v1.
            assert (await inside.get("/admin/tenants", headers=admin)).status_code == 200
            assert_openai_error(await inside.get("/admin/tenants", headers=tenant), 403, code="admin_key_required")
            assert_openai_error(await inside.get("/v1/models", headers=tenant), 404, code="not_found")
            # Health on both (a probe may use either); the console, usage and limits on both: they
            # serve an admin key and a tenant's alike.
            assert {(await c.get("/healthz")).status_code for c in (outside, inside)} == {503}
            for c in (outside, inside):
                assert (await c.get("/console/")).status_code == 200
                assert (await c.get("/console/console.js")).status_code == 200
                assert (await c.get("/v1/limits", headers=admin)).status_code == 200
                assert (await c.get("/v1/usage/completions", headers=tenant, params=dict(start_time=0))
                        ).status_code == 200
            assert_openai_error(await inside.get("/v1/files", headers=tenant), 404, code="not_found")
    finally:
        server.should_exit = True
        await task
