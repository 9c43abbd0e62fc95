"""Crash reports: the exception that ended a process, with the frame it came from."""

from __future__ import annotations

import pytest

from dsv4rl.faults.crash_report import build_report, crash_report, is_crash, read_crash_report
from dsv4rl.faults.files import process_of


def load_weights(path: str) -> None:
    raise ValueError(f"no weights in {path}\nsecond line")


def test_an_exception_leaves_a_report_and_goes_on(tmp_path):
    path = tmp_path / "crash-trainer-rank0.json"
    with pytest.raises(ValueError, match="no weights"), crash_report(path, "trainer-rank0"):
        load_weights("/models/x")
    report = read_crash_report(path)
    assert (report.process, report.type) == ("trainer-rank0", "ValueError")
    assert report.message.startswith("no weights in /models/x")
    assert report.frame.endswith(
        f"test_crash_report.py:{load_weights.__code__.co_firstlineno + 1} in load_weights"
    )
    assert report.project_frame is None  # no dsv4rl frame on the way (a test is not dsv4rl)
    assert "Traceback (most recent call last)" in report.traceback and "load_weights" in report.traceback
    assert report.headline() == f"ValueError: no weights in /models/x ... (at {report.frame})"
    assert process_of(path, "crash") == "trainer-rank0"


def test_a_raise_outside_dsv4rl_names_the_dsv4rl_frame_that_called_it(tmp_path):
    from dsv4rl.config.compose import load_config_file

    path = tmp_path / "config.yaml"
    path.write_text("run: [1, 2\n")  # YAML that does not parse: raised inside the yaml package
    try:
        load_config_file(path)
    except Exception as error:  # noqa: BLE001 - whatever the YAML parser raises
        report = build_report(error, "trainer-rank0")
    assert "yaml" in report.frame and report.type.startswith("yaml.")
    assert "dsv4rl/config/compose.py:" in report.project_frame
    assert report.project_frame.endswith(" in load_config_file")
    assert f"called from {report.project_frame})" in report.headline()


@pytest.mark.parametrize(
    ("error", "reported"),
    [
        (SystemExit(0), False),
        (SystemExit(None), False),
        (SystemExit(2), False),  # argparse and friends: they printed why
        (SystemExit("config file missing"), True),
        (KeyboardInterrupt(), False),
        (RuntimeError("boom"), True),
    ],
)
def test_which_exits_are_crashes(tmp_path, error, reported):
    path = tmp_path / "crash.json"
    with pytest.raises(type(error)), crash_report(path, "eval"):
        raise error
    assert is_crash(error) is reported and path.exists() is reported
