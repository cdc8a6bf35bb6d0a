"""What the planner asks a node to do. Plain data: the daemon executes them."""

from __future__ import annotations

import enum

import attrs

from fsm.instance import DeleteReason


class StopReason(enum.Enum):
    INSTANCE_GONE = "instance_gone"  # deleted, or no longer in the desired state
    RUNNER_FAILED = "runner_failed"  # Failed is terminal: stop it, never revive it
    SIBLING_FAILED = "sibling_failed"  # one_for_all: a rank of the same generation failed
    RECOVERING = "recovering"  # the instance is tearing the generation down
    STALE_GENERATION = "stale_generation"  # a newer generation has been started


@attrs.frozen
class CancelRequest:
    request_id: str
    instance_id: str
    reason: str


@attrs.frozen
class StopRunner:
    runner_id: str
    incarnation: int
    reason: StopReason


@attrs.frozen
class DeleteInstance:
    instance_id: str
    reason: DeleteReason


@attrs.frozen
class StartGeneration:
    instance_id: str
    generation: int


@attrs.frozen
class CreateRunner:
    instance_id: str
    runner_id: str
    node_id: str
    rank: int
    world_size: int
    incarnation: int
    model_id: str


@attrs.frozen
class StartDownload:
    node_id: str
    model_id: str


@attrs.frozen
class ConnectRunner:
    runner_id: str
    incarnation: int


@attrs.frozen
class LoadModel:
    runner_id: str
    incarnation: int
    model_id: str


@attrs.frozen
class WarmUp:
    runner_id: str
    incarnation: int


@attrs.frozen
class ForwardRequest:
    request_id: str
    runner_id: str
    incarnation: int


Action = (
    CancelRequest
    | StopRunner
    | DeleteInstance
    | StartGeneration
    | CreateRunner
    | StartDownload
    | ConnectRunner
    | LoadModel
    | WarmUp
    | ForwardRequest
)
