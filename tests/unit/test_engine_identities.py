"""Engine identities across replicas on the real Redis: the leader announces digests with its lease
renewals, the others adopt them on a refresh and check its engines' secrets; a replica that lost the
lease announces nothing; Redis holds no secret."""

from __future__ import annotations

import pytest

from gateway.config.sections import RedisConfig
from gateway.control.engine_identities import EngineIdentities, digest
from gateway.replicas.leadership import LOST, RENEWED, LeaderLease
from gateway.replicas.shared_state import SharedState, connect
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix, table

pytestmark = pytest.mark.timeout(30)
GPUS = {"h100-0": "H100", "l40s-0": "L40S"}
MANAGED = list(GPUS)


def test_a_launcher_checks_its_own_engines_and_a_follower_nothing_until_told() -> None:
    launcher = EngineIdentities.drawn(MANAGED)
    follower = EngineIdentities.drawn(MANAGED, launching=False)
    secret = launcher.secret("h100-0")
    assert launcher.verify("h100-0", secret) and not launcher.verify("h100-0", secret + "x")
    assert not launcher.verify("h100-0", "") and not launcher.verify("nobody", secret)
    assert not follower.verify("h100-0", secret) and not follower.verify("h100-0", follower.secret("h100-0"))
    follower.adopt({**launcher.own, "nobody": digest("x")})
    assert follower.verify("h100-0", secret) and not follower.verify("nobody", "x")
    launcher.adopt(follower.own)            # a launcher keeps its own, whatever Redis says
    assert launcher.verify("h100-0", secret)


async def test_the_leader_announces_digests_that_the_other_replicas_adopt_and_a_deposed_one_cannot_overwrite() -> (
    None
):
    with redis_prefix("identities") as prefix:
        config = RedisConfig(key_prefix=prefix)
        redis = connect(config, SYSTEM_REDIS)
        ids = {name: EngineIdentities.drawn(MANAGED, launching=False) for name in ("a", "b")}
        tables = {name: table(GPUS) for name in ids}
        shared = {name: SharedState(tables[name], redis, config, name, on_identities=ids[name].adopt) for name in ids}
        leases = {name: LeaderLease(redis, prefix + "leader", name, 1000, 1.0, shared[name].identities_key,
                                    ids[name].own) for name in ids}
        try:
            assert await leases["a"].acquire()
            ids["a"].set_launching(True)
            assert await leases["a"].renew() == RENEWED
            stored = await redis.hgetall(shared["a"].identities_key)
            assert stored == ids["a"].own
            assert ids["a"].secret("h100-0") not in str(stored)     # digests only
            await shared["b"].refresh()
            assert ids["b"].verify("h100-0", ids["a"].secret("h100-0"))
            assert ids["b"].verify("l40s-0", ids["a"].secret("l40s-0"))
            assert not ids["b"].verify("h100-0", ids["b"].secret("h100-0"))
            # b is not the holder: its renewal changes neither the lease nor the digests
            assert await leases["b"].renew() == LOST
            assert await redis.hgetall(shared["a"].identities_key) == ids["a"].own
            # the lease moves to b: b's digests replace a's, and a (stepped down) follows them
            await redis.delete(leases["a"].key)
            assert await leases["b"].acquire()
            ids["b"].set_launching(True)
            ids["a"].set_launching(False)
            assert await leases["b"].renew() == RENEWED
            await shared["a"].refresh()
            assert ids["a"].verify("h100-0", ids["b"].secret("h100-0"))
            assert not ids["a"].verify("h100-0", ids["a"].secret("h100-0"))
        finally:
            for s in shared.values():
                await s.withdraw()
            await redis.aclose()
