"""The sweep's state directory: the driver's own record of finished trials (the first place a trial's fate is
written), and where the Optuna journal, the workers' checkpoints and the test stage's kvpress layout live."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from grkv_core.evaluation.kvpress_layout import KVPRESS_FOLDER, KvpressRun, write_run
from grkv_core.files import write_atomically
from workers.names import CHECKPOINT_FOLDER, FULL_STAGE, SCREEN_STAGE, TEST_STAGE
from workers.protocol import TrialOutcome


class StateDirError(RuntimeError):
    """The sweep's state directory (or its Optuna journal) cannot be used; the message is one line."""


class StateDir:
    """The driver's own record of finished trials: ``<state>/<sweep>/<folder>/<key>.json``, one folder a stage
    (``trials/3.json``, ``screen/0.json``, ``test/eviction_only@0.88.json``)."""

    FOLDERS = {FULL_STAGE: "trials", SCREEN_STAGE: "screen", TEST_STAGE: "test"}

    def __init__(self, root: Path, sweep_id: str):
        self.root = Path(root) / sweep_id

    def create(self) -> None:
        """Create the folders and prove a file can be written there, or raise ``StateDirError``."""
        created = None if self.root.exists() else self.root
        while created is not None and not created.parent.exists():
            created = created.parent
        try:
            for folder in self.FOLDERS.values():
                (self.root / folder).mkdir(parents=True, exist_ok=True)
            probe = self.root / ".write-probe"
            with open(probe, "wb") as file:
                file.write(b"grkv")
                os.fsync(file.fileno())
            probe.unlink()
        except OSError as error:
            if created is not None:  # nothing half-created: the folders this call made go again
                shutil.rmtree(created, ignore_errors=True)
            raise StateDirError(self.unwritable(error)) from None

    def unwritable(self, error: OSError) -> str:
        return (
            f"state dir {self.root} cannot be written ({error.strerror or error}); free space or fix "
            "storage.state_dir / --state-dir"
        )

    def path(self, stage: str, key: str) -> Path:
        return self.root / self.FOLDERS[stage] / f"{key}.json"

    @property
    def kvpress(self) -> Path:
        """The test stage's results in kvpress's evaluation layout, a folder per test item (``kvpress/<test_of>/``;
        ``grkv leaderboard`` reads them beside kvpress's own)."""
        return self.root / KVPRESS_FOLDER

    def kvpress_folder(self, outcome: TrialOutcome) -> Path | None:
        """Where ``save`` wrote ``outcome``'s runs in kvpress's layout; None if it has none."""
        return self.kvpress / outcome.key if outcome.kvpress_runs else None

    def save(self, outcome: TrialOutcome) -> None:
        """Write ``outcome``: its runs in kvpress's layout, then its record.

        NOTE: the record last: a resume takes an outcome whose record exists as finished (and only logs it), so a
        driver killed between the two must leave no record, and the trial runs again (rewriting its kvpress folder).
        """
        try:
            for run in outcome.kvpress_runs:
                write_run(self.kvpress_folder(outcome), KvpressRun.from_dict(run))
            write_atomically(self.path(outcome.stage, outcome.key), json.dumps(outcome.to_dict()))
        except OSError as error:
            raise StateDirError(self.unwritable(error)) from None

    def load(self, stage: str, key: str) -> TrialOutcome | None:
        path = self.path(stage, key)
        return TrialOutcome.from_dict(json.loads(path.read_text())) if path.exists() else None

    @property
    def driver_times(self) -> Path:
        """The driver's seconds per evaluation (``sweeps.state.driver_times``), a JSON line each."""
        return self.root / "driver_times.jsonl"

    def log_times(self, row: dict) -> None:
        try:
            with open(self.driver_times, "a") as file:
                file.write(json.dumps(row) + "\n")
        except OSError as error:
            raise StateDirError(self.unwritable(error)) from None

    @property
    def journal(self) -> Path:
        return self.root / "optuna.journal"

    @property
    def checkpoints(self) -> str:
        """Where workers keep the per-sample results of the trials they are evaluating (``TrialRequest``)."""
        return str(self.root / CHECKPOINT_FOLDER)
