"""What ``ray stop`` does, done to one cluster's processes only (the real command stops every Ray on the machine).

Ray 2.60's ``ray stop`` (``ray/scripts/scripts.py``, ``stop``) walks ``RAY_PROCESSES``
(``ray/autoscaler/_private/constants.py``) in three buckets: the raylet; every other Ray process (plasma store,
autoscaler monitor, client server, workers, ``ray::`` processes such as actors and the job supervisor, log monitor,
dashboard agent, dashboard, runtime env agent, process reaper); the GCS server. In each bucket it sends SIGTERM to
every process whose name (or command line) carries one of the bucket's keywords, keyword by keyword, waits up to a
third of ``--grace-period`` (16 s by default) for them to exit, and SIGKILLs the rest. A job's driver (``python
sweep.py``) and the ``ray start --block`` leader match no keyword: ``ray stop`` leaves them to what follows. Last,
it removes the machine's record of its latest cluster (``/tmp/ray/ray_current_cluster``), which stops nothing and is
left out here: it is every cluster's on the machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
from ray.autoscaler._private.constants import RAY_PROCESSES

# ``ray stop``'s default ``--grace-period``
GRACE_PERIOD_S = 16


def cluster_processes(leader: psutil.Process, temp_dir: str, known: set[psutil.Process]) -> set[psutil.Process]:
    """The processes of the cluster started by ``leader`` (its ``ray start --block``) with ``--temp-dir=temp_dir``.

    Its descendants, and any process whose command line names the cluster's temp dir: a process outlives its parent
    only re-parented, so the processes seen before (``known``, psutil handles that guard against pid reuse) and
    their own descendants are kept. Nothing here can be another cluster's: each cluster of the machine has its
    own leader and temp dir.
    """
    found = {process for process in known if process.is_running()}
    roots = [leader, *found] if leader.is_running() else list(found)
    for root in roots:
        try:
            found.update(root.children(recursive=True))
        except psutil.Error:
            pass
    marker = str(Path(temp_dir)) + "/"
    for process in psutil.process_iter(["cmdline"]):
        arguments = process.info["cmdline"] or []
        if any(marker in argument or argument.endswith("=" + str(Path(temp_dir))) for argument in arguments):
            found.add(process)
    found.discard(leader)  # NOTE: `ray stop` matches no keyword on `ray start`; kept out so no bug signals it
    return found


def ray_stop(leader_pid: int, temp_dir: str, grace_period_s: float = GRACE_PERIOD_S) -> list[tuple[str, int, str]]:
    """Stop the cluster of ``leader_pid`` as ``ray stop`` would: same buckets, order, keywords and signals, only
    this cluster's processes. Returns what was signalled, in order: (signal, pid, the keyword it matched)."""
    leader = psutil.Process(leader_pid)
    known: set[psutil.Process] = set()
    signalled = []
    buckets = [RAY_PROCESSES[:1], RAY_PROCESSES[1:-1], RAY_PROCESSES[-1:]]
    for bucket in buckets:
        # NOTE: as `ray stop`, each bucket looks at the processes anew (a worker may have started meanwhile).
        known = cluster_processes(leader, temp_dir, known)
        infos = []
        for process in sorted(known, key=lambda process: process.pid):
            try:
                infos.append((process, process.name(), process.cmdline()))
            except psutil.Error:
                pass
        terminated = []
        for keyword, by_name in bucket:
            for process, name, arguments in infos:
                if keyword in (name if by_name else subprocess.list2cmdline(arguments)):
                    try:
                        process.terminate()
                    except psutil.NoSuchProcess:
                        continue
                    terminated.append(process)
                    signalled.append(("SIGTERM", process.pid, keyword))
        _, alive = psutil.wait_procs(list(dict.fromkeys(terminated)), timeout=grace_period_s / len(buckets))
        keywords = {pid: keyword for _, pid, keyword in signalled}
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
            signalled.append(("SIGKILL", process.pid, keywords[process.pid]))
        psutil.wait_procs(alive, timeout=2)
    return signalled
