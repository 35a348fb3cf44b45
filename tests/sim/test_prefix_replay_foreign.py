"""The prefix replay with other clients' requests sent straight to the fastest engines (`--foreign`): the
gateway sees them only in the engines' reports. Pricing them (the state table's foreign backlog and
running requests) must send fewer of the gateway's own requests to those engines than leaving them
unpriced (`hg-noforeign`), and every other client's request is served, once."""

from __future__ import annotations

from benchmarks.prefix_affinity import run


def test_engines_other_clients_saturate_get_fewer_of_the_gateways_requests() -> None:
    rows, _ = run(["multiturn"], ["hg-noforeign", "hg-cache"], [1], [0.9], 60, 0, 0, 4, 0.2, log=lambda _: None,
                  foreign_share=1.0)
    unpriced, priced = ({k: v for k, v in r.items() if k != "target"} for r in rows)
    # (virtual time, seeded: the same figures every run; 3% against 16% of the requests on the H100s)
    assert priced["tier_shares"].get("H100", 0.0) < unpriced["tier_shares"].get("H100", 0.0) - 0.02
    assert priced["ttft_p90_s"] < unpriced["ttft_p90_s"]
    assert priced["foreign_requests"] > 0 and priced["requests"] == unpriced["requests"]
