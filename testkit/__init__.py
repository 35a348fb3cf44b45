"""What the tests, the benchmarks and the load tests share to run the real thing on loopback: a gateway process
and its engines (`harness`), fault injection and metric reads, and the routing traces of the replica studies
(`herding`). Not part of the installed package."""
