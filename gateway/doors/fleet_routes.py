"""The admin routes that change the fleet at runtime (gateway/control/fleet.py), behind the admin key.

    POST   /admin/backends              one entry of backends.yaml's `backends:` as JSON → 201, the backend
    POST   /admin/backends/{id}/drain   no new requests, its own finish, a managed engine stops → 202
    DELETE /admin/backends/{id}         drain, then out of the fleet → 202

Drains and removals go on in the background: /admin/backends shows `draining: true`, then `state:
stopped` (managed), and no entry once removed. A refused change answers 400 (invalid entry), 404
(unknown id) or 409 (a sound request the fleet's state refuses: id in use, removal under way, the last
backend serving language work, replicas), in the OpenAI error shape. Each call holds the fleet while it
is applied (`Fleet.exclusive`): one made during a reload is answered once that reload is through.

An entry with `launch.command` (a `kind: openai` engine the gateway starts) runs that command on this
host: the API takes one only from an admin key, so a gateway with no admin keys refuses it with 403
(the file and SIGHUP still add it). Every other change takes an admin key too, except on a gateway with
no keys at all (auth off), where it is open to whoever reaches the port.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.control.fleet import Fleet
from gateway.doors.http_server import Request
from gateway.doors.route_table import Reply, RouteTable, json_reply
from gateway.requests.errors import Forbidden, InvalidRequest
from gateway.runtime import Runtime

# (request, *, admin): raises Unauthorized (no valid key) or Forbidden (a valid key, not an admin's)
Authorize = Callable[..., None]


def add_fleet_routes(table: RouteTable, runtime: Runtime, fleet: Fleet, authorize: Authorize) -> None:
    def described(backend_id: str) -> dict[str, Any]:
        return next((b for b in runtime.describe_backends() if b["id"] == backend_id), {"id": backend_id})

    async def add_backend(request: Request, _: str) -> Reply:
        authorize(request, admin=True)
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the body is not JSON: {exc}", code="invalid_backend") from None
        if not runtime.keys.admin and isinstance(body, dict) and isinstance(launch := body.get("launch"), dict) \
                and "command" in launch:
            raise Forbidden("an entry with launch.command runs that command on the gateway's host: adding one "
                            "through the API needs an admin key (gateway.auth.admin_keys_file or admin_keys_env); "
                            "without one, add it to the backends file and send SIGHUP")
        async with fleet.exclusive():
            backend_id = fleet.add(body)
        return json_reply(described(backend_id), 201)

    async def drain_backend(request: Request, backend_id: str) -> Reply:
        authorize(request, admin=True)
        async with fleet.exclusive():
            fleet.drain(backend_id)
        return json_reply(described(backend_id), 202)

    async def remove_backend(request: Request, backend_id: str) -> Reply:
        authorize(request, admin=True)
        async with fleet.exclusive():
            fleet.remove(backend_id)
        return json_reply({"id": backend_id, "removing": True}, 202)

    table.add("POST", "/admin/backends", add_backend)
    table.add("POST", "/admin/backends/{backend_id}/drain", drain_backend)
    table.add("DELETE", "/admin/backends/{backend_id}", remove_backend)
