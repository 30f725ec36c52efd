#!/usr/bin/env python3
"""Monte Carlo of list scheduling on agent-shaped DAGs (docs/performance.md, S5).

Each DAG is one plan task, then N parallel chains of depth D, then one validate task that waits
for every chain; durations are i.i.d. exponential (or lognormal, sigma = 1) with mean 200 ms.
M workers run a list schedule: whenever a worker is free it takes the ready task with the
highest rank. The rank is the bottom level (the longest path to the end, this task included)
either by the true durations (a clairvoyant scheduler, or a plan whose estimates are exact) or
in tasks (what the coordinator does without estimates). Prints makespan / LB, LB = max(CP, W/M),
as mean and p95, and the same against the bound that counts the plan and validate tasks whole
(`ends`), and ends/LB itself: no schedule, however clairvoyant, is below `ends`, so the p95 of
ends/LB is a floor for the p95 of any scheduler's makespan / LB.

    python3 bench/dag-sim/dag_sim.py                   # 8x4@4, 4x3@2, 16x3@4, 4,000 trials
    python3 bench/dag-sim/dag_sim.py 8x4@4 --trials 1000 --dist lognormal
"""

import argparse
import heapq
import math
import random
import statistics


def trial(chains, depth, workers, dist, rank_by, rng):
    count = chains * depth + 2
    if dist == "exponential":
        dur = [rng.expovariate(1 / 200) for _ in range(count)]
    else:
        dur = [rng.lognormvariate(math.log(200) - 0.5, 1) for _ in range(count)]
    deps = {0: []}
    for chain in range(chains):
        for step in range(depth):
            task = 1 + chain * depth + step
            deps[task] = [0] if step == 0 else [task - 1]
    deps[count - 1] = [1 + chain * depth + depth - 1 for chain in range(chains)]
    kids = {task: [] for task in range(count)}
    for task, parents in deps.items():
        for parent in parents:
            kids[parent].append(task)
    by_time, by_count = [0.0] * count, [0] * count
    for task in reversed(range(count)):
        by_time[task] = dur[task] + max((by_time[k] for k in kids[task]), default=0.0)
        by_count[task] = 1 + max((by_count[k] for k in kids[task]), default=0)
    rank = by_time if rank_by == "time" else by_count
    waiting = {task: len(deps[task]) for task in range(count)}
    ready = [task for task in range(count) if waiting[task] == 0]
    now, free, running, done = 0.0, workers, [], 0
    while done < count:
        # Ties go to the lower id, as the coordinator's plan order does.
        ready.sort(key=lambda task: (-rank[task], task))
        while free and ready:
            task = ready.pop(0)
            heapq.heappush(running, (now + dur[task], task))
            free -= 1
        now, task = heapq.heappop(running)
        free += 1
        done += 1
        for kid in kids[task]:
            waiting[kid] -= 1
            if waiting[kid] == 0:
                ready.append(kid)
    total = sum(dur)
    lb = max(by_time[0], total / workers)
    ends = max(lb, dur[0] + dur[-1] + (total - dur[0] - dur[-1]) / workers)
    return now / lb, now / ends, ends / lb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["8x4@4", "4x3@2", "16x3@4"])
    parser.add_argument("--trials", type=int, default=4000)
    parser.add_argument("--dist", choices=["exponential", "lognormal"], default="exponential")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # ends/LB bounds every schedule, clairvoyant or not: no makespan is below `ends`.
    print(
        f"{'shape':<8} {'rank':<6} {'eager/LB mean':>13} {'p95':>6} {'eager/ends mean':>15} {'p95':>6}"
        f" {'ends/LB mean':>12} {'p95':>6}"
    )
    for shape in args.shapes:
        dag, workers = shape.split("@")
        chains, depth = (int(part) for part in dag.split("x"))
        for rank_by in ("time", "tasks"):
            rng = random.Random(args.seed)
            runs = [trial(chains, depth, int(workers), args.dist, rank_by, rng) for _ in range(args.trials)]
            lb = sorted(run[0] for run in runs)
            ends = sorted(run[1] for run in runs)
            bound = sorted(run[2] for run in runs)
            p95 = lambda values: values[math.ceil(0.95 * len(values)) - 1]
            print(
                f"{shape:<8} {rank_by:<6} {statistics.mean(lb):>13.3f} {p95(lb):>6.3f}"
                f" {statistics.mean(ends):>15.3f} {p95(ends):>6.3f}"
                f" {statistics.mean(bound):>12.3f} {p95(bound):>6.3f}"
            )


if __name__ == "__main__":
    main()
