"""What the daemon keeps, and for how long: the transition log, the runner logs, the hostfiles.

Why bounds at all: an instance in a crash loop starts a generation every few seconds, and each one adds
a dozen rows to the transition log, a log file per rank and a hostfile. Kept forever, a weekend of it
leaves a million rows and hundreds of thousands of files. What an operator needs to find out why is the
recent past, so that is what is kept:

* the transition log: its newest ``max_log_rows`` rows, none older than ``max_log_age_days``. The
  snapshot row holds the machines' state, so pruning the log loses no state, only history. The store
  prunes it (`exod.state.sqlite.Store.save`, in the transaction that appends) and says where it starts now
  (`Store.log_start`): `exod replay` and ``GET /events`` tell their reader that history was pruned.
* the runner logs of the last ``keep_runner_logs`` generations of each instance, and no hostfile of
  a generation that is over: nothing reads a hostfile once its ring is up. The controller calls
  `forget_generation` when a generation's last process is reaped, and `forget_instance` when it
  forgets a deleted instance.

The file layout is named here too (`runner_log_path`, `hostfile_path`), so what is written and what is deleted
cannot drift apart. Deleting is best effort: a file that cannot be deleted is logged, never raised,
because the caller is the controller's cleanup of a reaped process, which must not fail.
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
from pathlib import Path

import attrs
from attrs import validators as v

from fsm.cluster import Cluster
from fsm.log import LogEntry

log = logging.getLogger("exod.retention")

DAY_S = 86_400.0

_RUNNER_LOG = re.compile(r"rank\d+-gen(\d+)\.log")
_HOSTFILE = re.compile(r"gen(\d+)\.hostfile\.json")


@attrs.frozen
class Retention:
    """The bounds (``[retention]`` in the config). Each is a maximum: pruning may keep a little less."""

    max_log_rows: int = attrs.field(default=100_000, validator=[v.instance_of(int), v.gt(0)])
    max_log_age_days: float = attrs.field(default=30.0, validator=v.gt(0))
    keep_runner_logs: int = attrs.field(default=3, validator=[v.instance_of(int), v.ge(1)])

    @property
    def max_log_age(self) -> float:
        """``max_log_age_days`` in seconds."""
        return self.max_log_age_days * DAY_S


def runner_log_path(state_dir: Path, instance_id: str, rank: int, generation: int) -> Path:
    """Where rank ``rank`` of generation ``generation`` writes its stdout and stderr."""
    return _instance_dir(state_dir, "logs", instance_id) / f"rank{rank}-gen{generation}.log"


def runner_logs(state_dir: Path, instance_id: str) -> dict[tuple[int, int], Path]:
    """The runner logs this node keeps for an instance, by (rank, generation)."""
    directory = _instance_dir(state_dir, "logs", instance_id)
    found = {}
    for path in directory.glob("rank*-gen*.log") if directory.is_dir() else ():
        rank, _, generation = path.stem.removeprefix("rank").partition("-gen")
        if rank.isdigit() and generation.isdigit():
            found[(int(rank), int(generation))] = path
    return found


def hostfile_path(state_dir: Path, instance_id: str, generation: int) -> Path:
    """Where generation ``generation`` of the instance finds its MLX ring (`exod.host.ring.hostfile` writes it)."""
    return _instance_dir(state_dir, "run", instance_id) / f"gen{generation}.hostfile.json"


def forget_generation(state_dir: Path, instance_id: str, generation: int, keep_logs: int) -> None:
    """Generation ``generation`` was reaped: delete its hostfile and the runner logs of generations older than
    the last ``keep_logs`` (``generation - keep_logs + 1`` and newer are kept).

    Older hostfiles go too: those of a generation a killed daemon left behind are found at the next reap.
    """
    if keep_logs < 1:
        raise ValueError(f"keep_logs must be >= 1 (the logs of the generation that just ended), got {keep_logs}")
    _delete(_instance_dir(state_dir, "run", instance_id), _HOSTFILE, through=generation)
    _delete(_instance_dir(state_dir, "logs", instance_id), _RUNNER_LOG, through=generation - keep_logs)


def forget_instance(state_dir: Path, instance_id: str) -> None:
    """The instance was forgotten: delete its runner logs and hostfiles, directories and all."""
    for kind in ("run", "logs"):
        directory = _instance_dir(state_dir, kind, instance_id)
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete %s (%s); delete it by hand to reclaim the space", directory, exc)


def forget_deleted(cluster: Cluster, state_dir: Path, now: float, keep: int) -> None:
    """Keep the newest ``keep`` deleted instances (for `status`: why did it go?); forget older ones, with their
    files, and log that they went."""
    done = [iid for iid, pl in cluster.instances.items() if pl.machine.is_deleted and not cluster.has_live_runners(iid)]
    for iid in done[: max(0, len(done) - keep)]:
        cluster.forget(iid)
        forget_instance(state_dir, iid)
        cluster.log.append(LogEntry(now, "instance", iid, "forget", "deleted", ""))


def _instance_dir(state_dir: Path, kind: str, instance_id: str) -> Path:
    """``state_dir/kind/instance_id``, refusing an id that is not one plain path component (it is deleted)."""
    if instance_id in ("", ".", "..") or "/" in instance_id or "\0" in instance_id:
        raise ValueError(f"instance id {instance_id!r} is not a single path component")
    return Path(state_dir) / kind / instance_id


def _delete(directory: Path, pattern: re.Pattern[str], *, through: int) -> None:
    """Delete the files of ``directory`` whose name matches ``pattern`` with a generation <= ``through``."""
    try:
        names = [entry.name for entry in directory.iterdir()]
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot list %s (%s); its old runner files stay until it can be read", directory, exc)
        return
    for name in names:
        if (match := pattern.fullmatch(name)) is None or int(match[1]) > through:
            continue
        try:
            (directory / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete %s (%s); delete it by hand to reclaim the space", directory / name, exc)


class Generations:
    """Counts each generation's live processes, to forget its files when its last one is reaped.

    Keyed by instance and generation, not by machine: by the time a process's end is seen, its runner
    machine, or its whole instance, may already be forgotten.
    """

    def __init__(self, state_dir: Path, retention: Retention) -> None:
        self.state_dir, self.retention = state_dir, retention
        self._alive: collections.Counter[tuple[str, int]] = collections.Counter()

    def started(self, instance_id: str, generation: int) -> None:
        self._alive[(instance_id, generation)] += 1

    def ended(self, instance_id: str, generation: int) -> None:
        key = (instance_id, generation)
        self._alive[key] -= 1
        if self._alive[key] <= 0:  # its last process is reaped: the generation is over
            del self._alive[key]
            forget_generation(self.state_dir, instance_id, generation, self.retention.keep_runner_logs)
