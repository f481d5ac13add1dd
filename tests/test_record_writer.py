"""The driver's writer (``sweeps.state.writer``): what it is handed is made in order on a thread of its own; the first
failure stops it and reaches the driver; a writer behind holds the driver back; and the reads a thread makes while it
asks for a trial (``trials_read_once``) are its own."""

import threading
import time

import optuna
import pytest

from sweeps.space import trials_read_once
from sweeps.state.writer import RecordWriter, Skipped


def test_calls_are_made_in_order_on_one_thread_that_is_not_the_callers():
    writer = RecordWriter()
    made = []
    futures = [writer.submit(lambda i=i: made.append((i, threading.get_ident())) or i)[0] for i in range(50)]
    writer.drain()
    assert [future.result() for future in futures] == list(range(50))
    assert [i for i, _ in made] == list(range(50))
    assert {thread for _, thread in made} != {threading.get_ident()} and len({thread for _, thread in made}) == 1
    writer.close()


def test_the_first_failure_skips_what_follows_and_is_raised_to_the_driver():
    writer = RecordWriter()
    made = []
    lost = ConnectionError("MLflow lost")

    def fail():
        raise lost

    first, _ = writer.submit(made.append, 1)
    failed, _ = writer.submit(fail)
    after, _ = writer.submit(made.append, 2)
    assert writer.settle() is lost
    assert made == [1] and failed.exception() is lost and isinstance(after.exception(), Skipped)
    with pytest.raises(ConnectionError, match="MLflow lost"):
        writer.check()
    with pytest.raises(ConnectionError):
        writer.submit(made.append, 3)
    with pytest.raises(ConnectionError):
        writer.drain()
    assert made == [1]
    writer.close()


def test_a_writer_behind_holds_the_driver_back_and_says_how_long():
    writer = RecordWriter(max_pending=2)
    released = threading.Event()
    writer.submit(released.wait)
    writer.submit(lambda: None)
    threading.Timer(0.3, released.set).start()
    _, waited = writer.submit(lambda: None)
    assert released.is_set() and waited >= 0.25
    _, waited = writer.submit(lambda: None)
    assert waited < 0.25
    writer.drain()
    writer.close()


def test_reads_once_are_the_asking_threads_only(tmp_path):
    """Within ``trials_read_once`` the asking thread reads the study as it was at its first read; another thread (the
    writer telling a trial) reads the storage as it is."""
    study = optuna.create_study(storage=optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}"))
    study.tell(study.ask(), 1.0)
    seen = {}
    with trials_read_once(study):
        assert len(study._storage.get_all_trials(study._study_id)) == 1
        study.tell(study.ask(), 2.0)
        seen["asking"] = len(study._storage.get_all_trials(study._study_id))
        reader = threading.Thread(target=lambda: seen.update(other=len(study.get_trials(deepcopy=False))))
        reader.start()
        reader.join()
    assert seen == {"asking": 1, "other": 2}
    assert len(study.get_trials()) == 2


def test_a_write_in_progress_is_waited_for_when_the_driver_drains():
    writer = RecordWriter()
    finished = []
    writer.submit(lambda: (time.sleep(0.2), finished.append(True)))
    writer.drain()
    assert finished == [True]
    writer.close()


def test_lanes_keep_each_lanes_order_and_go_on_beside_a_busy_one_and_one_failure_stops_them_all():
    writer = RecordWriter(lanes=2)
    released, made = threading.Event(), []
    writer.submit(released.wait, lane=0)
    writer.submit(made.append, "0 after the wait", lane=0)
    for index in range(5):
        writer.submit(made.append, f"1.{index}", lane=1)
    deadline = time.monotonic() + 10
    while len(made) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made == [f"1.{index}" for index in range(5)]  # lane 1 went on while lane 0 waited
    released.set()
    writer.drain()
    assert made[-1] == "0 after the wait"

    def fail():
        raise OSError("state directory full")

    blocked = threading.Event()
    writer.submit(blocked.wait, lane=1)
    writer.submit(made.append, "1 after the failure", lane=1)
    writer.submit(fail, lane=0)
    deadline = time.monotonic() + 10
    while writer.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    blocked.set()
    assert isinstance(writer.settle(), OSError) and "1 after the failure" not in made
    writer.close()
