"""`encode_cost` with the encoders' index: a predicted embedding-cache hit is no encode on that encoder."""

from __future__ import annotations

from common.prefix_blocks import content_digest
from gateway.routing.encoder_index import EncoderIndex
from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from gateway.routing.policies.encode_cost import EncodeCost
from tests.snapshots import snapshot

CAT, DOG = (content_digest(b"cat"), 576), (content_digest(b"dog"), 576)


def vision(backend_id: str, gpu: str, backlog: int = 0) -> BackendSnapshot:
    return snapshot(backend_id, gpu, role="vision", vision_backlog=backlog)


def image_request(cached: dict[str, int]) -> RequestProfile:
    return RequestProfile("r", 576 + 100, 16, 576, cached_image_tokens=cached)


def test_the_encoder_that_holds_an_image_gets_it_again_and_its_cost_is_the_queue_only() -> None:
    index = EncoderIndex()
    a, b = vision("a", "L40S"), vision("b", "L40S")
    policy = EncodeCost()
    assert policy.choose(image_request(index.cached([CAT])), [a, b], 0.0).backend.id == "a"   # a tie: the first
    index.record([DOG], "b")
    decision = policy.choose(image_request(index.cached([DOG])), [a, b], 0.0)
    assert decision.backend.id == "b"
    assert decision.costs[1].prefill == 0.0 and decision.costs[0].prefill > 0


def test_a_hit_gives_way_when_the_holders_backlog_costs_more_than_encoding_elsewhere() -> None:
    index = EncoderIndex()
    index.record([DOG], "b")
    cached = index.cached([DOG])
    policy = EncodeCost()
    idle = vision("a", "L40S")
    assert policy.choose(image_request(cached), [idle, vision("b", "L40S", backlog=500)], 0.0).backend.id == "b"
    assert policy.choose(image_request(cached), [idle, vision("b", "L40S", backlog=700)], 0.0).backend.id == "a"


def test_a_hit_on_a_slow_encoder_is_weighed_against_a_miss_on_a_fast_one() -> None:
    index = EncoderIndex()
    index.record([CAT], "slow")
    fast, slow = vision("fast", "H100"), vision("slow", "L4")
    policy = EncodeCost()
    request = image_request(index.cached([CAT]))
    assert policy.choose(request, [fast, slow], 0.0).backend.id == "slow"
    # the slow one's queue at ~1.2x a fast encode of the image: the fast miss wins
    t_fast, t_slow = fast.encode_s_per_token, slow.encode_s_per_token
    backlog = int(1.2 * 576 * t_fast / t_slow) + 1
    assert policy.choose(request, [fast, vision("slow", "L4", backlog=backlog)], 0.0).backend.id == "fast"


def test_the_index_is_bounded_per_encoder_and_forgets_least_recent_first() -> None:
    index = EncoderIndex(images_per_encoder=3)
    images = [(content_digest(bytes([k])), 100) for k in range(5)]
    for image in images:
        index.record([image], "a")
    index.record(images[:1], "b")
    assert index.held("a") == 3 and index.held("b") == 1
    assert index.cached(images[:2]) == {"b": 100}    # a forgot images 0 and 1
    assert index.cached(images[2:]) == {"a": 300}
    index.record([images[2]], "a")                   # touched: 3 is now the least recent
    index.record([(content_digest(b"new"), 100)], "a")
    assert index.cached(images[2:]) == {"a": 200}
    assert index.cached([(content_digest(b"never"), 100)]) == {}


def test_an_encoder_that_restarted_is_forgotten_once_it_reports_another_process() -> None:
    index = EncoderIndex()
    index.record([CAT], "a", pid=100)
    index.record([CAT, DOG], "b")                     # its process not known yet
    assert not index.observe("a", 100) and not index.observe("a", 0)   # the same process, or none said
    assert index.cached([CAT]) == {"a": 576, "b": 576}
    assert index.observe("a", 101)                    # a new process: an empty embedding cache
    assert index.cached([CAT, DOG]) == {"b": 1152} and index.held("a") == 0
    assert not index.observe("b", 7) and index.held("b") == 2   # the first process heard of: the baseline
    assert index.observe("b", 8) and index.cached([CAT]) == {}
    index.record([DOG], "a", pid=101)                 # sent again: held again
    assert index.cached([DOG]) == {"a": 576}


def test_an_encoder_that_reports_a_smaller_cache_is_predicted_to_hold_only_that_many() -> None:
    index = EncoderIndex(images_per_encoder=4)
    images = [(content_digest(bytes([k])), 100) for k in range(4)]
    index.record(images, "a")
    index.record(images, "b")
    assert index.observe("a", 0, cache_images=2)     # its engine keeps two: the two least recent go
    assert index.held("a") == 2 and index.cached(images) == {"a": 200, "b": 400}
    assert not index.observe("a", 0, cache_images=2) and not index.observe("a", 0)   # nothing new said
    index.record(images[:1], "a", cache_images=2)     # later records stay within its size
    assert index.held("a") == 2
    assert not index.observe("b", 0, cache_images=64) and index.held("b") == 4   # larger: the configured bound
    index.record(images[:1], "c", cache_images=0)     # it keeps no embeddings: no hit is ever predicted
    assert index.held("c") == 0 and "c" not in index.cached(images[:1])
