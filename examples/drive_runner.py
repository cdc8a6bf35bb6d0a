"""Drive one runner machine alone: rank 0 of a 2-rank instance, from spawn to an unexpected exit.

No processes, no planner, no clock: each line feeds the machine one event, the way
the daemon's supervisor would, and prints the leaf-to-leaf steps it took. The
process then exits while serving a request, so the last event shows the chain
``busy → failed → stopped`` and the failure it recorded.
Run: ``python examples/drive_runner.py``.
"""

from __future__ import annotations

from fsm import runner

RUNNER_ID, INCARNATION = "demo/0", 1


def main() -> None:
    machine = runner.RunnerLifecycle(RUNNER_ID, rank=0, world_size=2, incarnation=INCARNATION)
    events = [
        runner.Connect(RUNNER_ID, INCARNATION),
        runner.Connected(RUNNER_ID, INCARNATION),
        runner.Load(RUNNER_ID, INCARNATION),
        *(runner.Progress(RUNNER_ID, INCARNATION, layers_loaded=n, layers_total=4) for n in (1, 2, 3, 4)),
        runner.WeightsLoaded(RUNNER_ID, INCARNATION),
        runner.WarmUp(RUNNER_ID, INCARNATION),
        runner.Warmed(RUNNER_ID, INCARNATION),
        runner.RequestStarted(RUNNER_ID, INCARNATION),
        runner.RequestStarted(RUNNER_ID, INCARNATION),
        runner.RequestFinished(RUNNER_ID, INCARNATION),
        runner.Exited(RUNNER_ID, INCARNATION, exit_code=-9, detail="killed by the OOM killer"),
        runner.Warmed(RUNNER_ID, INCARNATION - 1),  # a stale incarnation: ignored
    ]
    print(f"{'event':<17} {'steps':<40} state")
    for event in events:
        outcome = machine.apply(event)
        if outcome.accepted:
            steps = ", ".join(f"{s.source} → {s.target}" for s in outcome.steps) or "(internal)"
        else:
            steps = f"ignored: {outcome.note}"
        extra = ""
        if event.name == "progress":
            extra = f"  layers {machine.layers_loaded}/{machine.layers_total}"
        elif event.name.startswith("request"):
            extra = f"  in flight {machine.in_flight}"
        print(f"{event.name:<17} {steps:<40} {machine.path}{extra}")
    print(f"\nfinal: {machine.runner_state.value}.{machine.phase.value}, alive={machine.alive}")
    failure = machine.failure
    print(f"failure: {failure.message} (retryable={failure.retryable}, stderr: {failure.detail!r})")


if __name__ == "__main__":
    main()
