#!/usr/bin/env bash
# The `gateway plan` runs behind docs/PLANNING.md's "The seed papers' findings": each writes its printed
# output (.txt) and JSON into docs/results/planning/ (or the folder given as $1). About 5 CPU-minutes in all.
set -euo pipefail
out="${1:-docs/results/planning}"
mkdir -p "$out"
tiers=(--gpus H100,A100-80GB,L40S,RTX-4090 --budget 30)
plan() {   # name, then the plan's own arguments
    local name=$1; shift
    gateway plan "$@" "${tiers[@]}" --json "$out/$name.json" > "$out/$name.txt"
    echo "$name: $(grep -m1 '^search' "$out/$name.txt")"
}
for rate in 40 120; do
    plan "fleet_share0_rate$rate" --rate "$rate" --image-share 0 --compare fleet --time-limit 900
    plan "fleet_share0.5_rate$rate" --rate "$rate" --image-share 0.5 --compare fleet --time-limit 900
    plan "fleet_sharegpt_rate$rate" --rate "$rate" --workload sharegpt --compare fleet --time-limit 900
done
for share in 0.2 0.5 0.9; do
    plan "split_share${share}_loose" --rate 40 --image-share "$share" --compare split
    plan "split_share${share}_tight" --rate 40 --image-share "$share" --ttft-slo 0.5 --itl-slo 0.05 --compare split
done
