"""The private Optuna internals the sweep's storage overrides and calls (``sweeps/state/rdb_storage.py``), pinned: a
release that renames a parameter, moves a method or stops calling an override fails here, by name, not in a sweep.
And an Optuna outside the tested range is refused in one line before a sweep starts."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.storages._cached_storage import _CachedStorage
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session

from sweeps.state.optuna_storage import TESTED_OPTUNA, optuna_outside_tested_range

REPO = Path(__file__).resolve().parents[1]

# Each private callable rdb_storage.py overrides or calls, with the parameter names it passes.
PRIVATE_SIGNATURES = {
    "RDBStorage._set_trial_param": (
        RDBStorage._set_trial_param,
        ["self", "trial_id", "param_name", "param_value_internal", "distribution", "previous_distribution"],
    ),
    "RDBStorage._set_trial_param_without_commit": (
        RDBStorage._set_trial_param_without_commit,
        ["self", "session", "trial_id", "param_name", "param_value_internal", "distribution", "previous_distribution"],
    ),
    "RDBStorage._get_trials": (
        RDBStorage._get_trials,
        ["self", "study_id", "states", "included_trial_ids", "trial_id_greater_than"],
    ),
    "RDBStorage._create_new_trial": (RDBStorage._create_new_trial, ["self", "study_id", "template_trial"]),
    "RDBStorage._get_best_trial_id": (RDBStorage._get_best_trial_id, ["self", "study_id", "direction"]),
    "RDBStorage._get_stale_trial_ids": (RDBStorage._get_stale_trial_ids, ["self", "study_id"]),
    "_create_scoped_session": (_create_scoped_session, ["scoped_session", "ignore_integrity_error"]),
}


@pytest.mark.parametrize("name", sorted(PRIVATE_SIGNATURES))
def test_every_private_optuna_name_the_storage_uses_keeps_its_signature(name):
    function, parameters = PRIVATE_SIGNATURES[name]
    assert list(inspect.signature(function).parameters) == parameters


def test_the_cache_still_writes_parameters_through_the_overridden_private_method():
    # NOTE: on Optuna 4.6 the cache called the public set_trial_param, so the retried override never ran.
    assert "self._backend._set_trial_param(" in inspect.getsource(_CachedStorage.set_trial_param)


def test_the_models_the_storage_writes_have_their_columns():
    assert callable(models.TrialModel.find_or_raise_by_id)
    columns = set(models.TrialParamModel.__table__.columns.keys())
    assert {"trial_id", "param_name", "param_value", "distribution_json"} <= columns
    assert "scoped_session" in inspect.getsource(RDBStorage.__init__)


def test_the_tested_range_is_the_declared_one_and_holds_the_installed_optuna():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sweep"]
    (optuna_range,) = [requirement for requirement in declared if requirement.startswith("optuna")]
    (low, high) = TESTED_OPTUNA
    assert optuna_range == f"optuna>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    assert optuna_outside_tested_range(optuna.__version__) is None


@pytest.mark.parametrize("version", ["4.5.0", "4.6.1", "5.1.0", "6.0.0.dev0"])
def test_an_optuna_outside_the_tested_range_is_named_in_one_line(version):
    reason = optuna_outside_tested_range(version)
    assert reason is not None and version in reason and "\n" not in reason
    assert re.search(r">=\d+\.\d+,<\d+\.\d+", reason)


def test_a_sweep_with_an_untested_optuna_stops_before_any_trial(tmp_path):
    # A fake release, as the driver reads it: the one line, exit 2, nothing written.
    code = (
        "import sys, optuna; optuna.__version__ = '4.5.0'; sys.argv = ['sweep.py', '--config', "
        f"'sweeps/configs/smoke.yaml', '--state-dir', {str(tmp_path / 'state')!r}]; "
        "import runpy; runpy.run_path('sweep.py', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("sweep:")]
    assert "Optuna 4.5.0 is outside the tested range" in line
    assert not (tmp_path / "state").exists()
