"""A retry policy of your own: a different backoff and budget, with seeded jitter.

Policy: first delay 0.5 s, ×3 per failed generation, capped at 10 s, full jitter,
and a budget of 3 failed generations. The script drives one `InstanceRetry`
(1 rank) through crash after crash, starting each new generation exactly at its
backoff deadline, and prints the schedule it got: the jitter is drawn from an
RNG seeded by (seed, instance, attempt), so the same seed prints the same
schedule on every run. Then it exports the machine's diagram as Mermaid, with
the state it ended in highlighted: to stdout, or to the file given as argument.

Run: ``python examples/custom_retry_policy.py [diagram.mmd]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fsm
from fsm import instance
from fsm.diagram import mermaid

POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.5, factor=3.0, cap=10.0, jitter=True), max_failures=3)
SEED = 42
ID = "custom"


def main(argv: list[str]) -> None:
    machine = fsm.InstanceRetry(ID, world_size=1, policy=POLICY, seed=SEED)
    b = POLICY.backoff
    print(f"policy: initial {b.initial} s, factor {b.factor}, cap {b.cap} s, jitter {b.jitter}, ", end="")
    print(f"max_failures {POLICY.max_failures}, seed {SEED}")
    print("schedule of the policy (retry n: ceiling min(cap, initial·factor^(n−1)) → jittered delay):")
    for n in range(1, 6):
        print(f"  retry {n}: {b.ceiling(n):6.3f} s → {machine.retry_delay(n):6.3f} s")
    print(f"\ndriven through crashes (budget {POLICY.max_failures} failed generations):")
    print(f"{'gen':>3}  {'started':>8}  {'failed':>7}  {'ceiling':>8}  {'delay':>7}  next")
    now = 0.0
    while not machine.is_deleted:
        generation = machine.generation + 1
        started = now
        machine.apply(instance.Start(ID, now, generation=generation))
        machine.apply(instance.RankCreated(ID, now, generation=generation, rank=0))
        machine.apply(instance.RankReady(ID, now + 0.1, generation=generation, rank=0))
        now += 1.0  # serves for a second, then crashes
        crash = fsm.Failure.exited(1, "CUDA error: out of memory")
        machine.apply(instance.RankFailed(ID, now, generation=generation, rank=0, failure=crash))
        if machine.is_deleted:
            print(f"{generation:>3}  {started:>8.3f}  {now:>7.3f}  {'':>8}  {'':>7}  deleted")
            break
        machine.apply(instance.RankStopped(ID, now, generation=generation, rank=0))  # reaped: backing off
        delay = machine.deadline - now
        ceiling = b.ceiling(machine.attempts)
        print(f"{generation:>3}  {started:>8.3f}  {now:>7.3f}  {ceiling:>8.3f}  {delay:>7.3f}  ", end="")
        print(f"{machine.instance_state.value} until t={machine.deadline:.3f}")
        now = machine.deadline
    print(
        f"\n{machine.instance_state.value} ({machine.delete_reason.value}) after {machine.attempts} failed generations"
    )
    print(f"last failure: {machine.last_failure.message}")

    diagram = mermaid(machine)  # an instance: its current state is highlighted
    if argv:
        Path(argv[0]).write_text(diagram, encoding="utf-8")
        print(f"diagram written to {argv[0]}")
    else:
        print("\n" + diagram, end="")


if __name__ == "__main__":
    main(sys.argv[1:])
