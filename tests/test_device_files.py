"""Device files (#51 item 5): ``hybrid-plan calibrate``'s file lives in the user's cache as the
data cache does (``$XDG_CACHE_HOME/hybrid``), records its host, hybrid version and time;
every prediction (``hybrid-plan``'s line and JSON, the search, the sweep report) names the
file it used and its age, and a file from another host or hybrid is refused in one line."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.cost import device_files
from hybrid.planning.cost.device_files import RECORD, calibrated_path, write_device_file
from hybrid.planning.cost.devices import PRESETS, DeviceError, load_device
from hybrid.planning.cost.trust import assumption_line

PLAN = str(Path(sys.executable).parent / "hybrid-plan")
CALIBRATED = replace(PRESETS["cpu"], name="calibrated:somewhere", error="calibrated here")


def calibration(path: Path, **record) -> Path:
    """A device file as ``hybrid-plan calibrate`` writes it, its record changed by ``record``."""
    write_device_file(CALIBRATED.to_dict(), path)
    data = json.loads(path.read_text())
    data[RECORD].update(record)
    path.write_text(json.dumps(data))
    return path


def test_the_device_file_lives_in_the_same_user_cache_as_the_data(tmp_path, monkeypatch):
    from hybrid.data.examples import user_cache_dir as data_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrated_path().parent == data_cache() == tmp_path / "xdg" / "hybrid"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibrated_path().parent == data_cache() == tmp_path / "home" / ".cache" / "hybrid"


def test_a_loaded_file_is_named_with_its_age_in_the_assumption(tmp_path):
    path = calibration(tmp_path / "device.json", at=time.time() - 3 * 3600)
    device = load_device(str(path))
    assert (device.file, device.flops) == (str(path), CALIBRATED.flops)
    line = assumption_line(device)
    assert line.startswith(f"predictions assume cost.device=calibrated:somewhere (device file "
                           f"{path}, measured 3.0 h ago): calibrated here"), line
    assert load_device("cpu").file == "" and "device file" not in assumption_line(PRESETS["cpu"])


@pytest.mark.parametrize("record, needle", [
    ({"host": "elsewhere"}, "was calibrated on host 'elsewhere', not this one"),
    ({"hybrid": "0.0.1"}, "was calibrated by hybrid 0.0.1, this is hybrid "),
])
def test_a_file_from_another_host_or_hybrid_is_refused_in_one_line(tmp_path, record, needle):
    path = calibration(tmp_path / "device.json", **record)
    with pytest.raises(DeviceError, match=needle):
        load_device(str(path))
    done = subprocess.run([PLAN, "model=tiny", "parallel=single", f"cost.device={path}"],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, lines
    assert lines[0].startswith(f"error: cost.device={path}: {path} {needle}")
    assert lines[0].endswith(f"; run hybrid-plan calibrate on this machine (it writes "
                             f"{calibrated_path()})")


def test_an_old_calibration_without_a_record_is_refused_and_a_hand_written_device_is_not(
        tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(CALIBRATED.to_dict()))
    with pytest.raises(DeviceError, match="is a calibration with no record of its host"):
        load_device(str(old))
    hand = tmp_path / "mine.json"
    hand.write_text(json.dumps(replace(PRESETS["a100-80gb"], name="my-a100").to_dict()))
    os.utime(hand, (time.time() - 600, time.time() - 600))
    assert "(device file %s, measured 10 min ago)" % hand in assumption_line(
        load_device(str(hand)))


def test_hybrid_plan_names_the_file_in_its_line_its_json_and_its_search(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    host_file = subprocess.run(
        [sys.executable, "-c", "from hybrid.planning.cost.device_files import calibrated_path;"
                               "print(calibrated_path())"],
        capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert host_file.startswith(str(tmp_path / "hybrid" / "device-"))
    calibration(Path(host_file).parent.mkdir(parents=True) or Path(host_file))
    common = [PLAN, "model=tiny", "parallel=single", "cost.device=calibrated"]
    text = subprocess.run(common, capture_output=True, text=True, timeout=60, env=env)
    assert text.returncode == 0, text.stderr[-2000:]
    assert (f"predictions assume cost.device=calibrated:somewhere (device file {host_file}, "
            f"measured ") in text.stdout
    planned = json.loads(subprocess.run([*common, "format=json"], capture_output=True,
                                        text=True, timeout=60, env=env).stdout)
    named = planned["predicted"]["device_file"]
    assert named["path"] == host_file and 0 <= named["age_s"] < 120
    searched = json.loads(subprocess.run(
        [*common, "search.world=2", "search.top=1", "format=json"], capture_output=True,
        text=True, timeout=60, env=env).stdout)
    assert searched["device_file"]["path"] == host_file
    assert f"(device file {host_file}, measured " in searched["assumes"]


def test_the_sweep_report_names_the_file_and_leaves_a_stale_one_unused(tmp_path, monkeypatch):
    from launch.reports.sweep_report import prediction_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert prediction_device("cpu") == PRESETS["cpu"]  # nothing calibrated here
    path = calibrated_path()
    path.parent.mkdir(parents=True)
    calibration(path)
    used = prediction_device("cpu")
    assert used.file == str(path) and f"(device file {path}" in assumption_line(used)
    calibration(path, host="elsewhere")
    unused = prediction_device("cpu")
    assert unused.name == "cpu" and unused.file == ""
    assert (f"the calibration was not used: cost.device=calibrated: {path} was calibrated on "
            f"host 'elsewhere'") in assumption_line(unused)


def test_calibrate_writes_the_record_it_is_checked_against(tmp_path):
    path = tmp_path / "device.json"
    write_device_file(load_device("cpu").to_dict() | {"file": "x", "file_time": 1.0}, path)
    data = json.loads(path.read_text())
    assert data[RECORD]["host"] == device_files.this_host()
    assert data[RECORD]["hybrid"] == device_files.hybrid_version()
    assert "file" not in data and abs(data[RECORD]["at"] - time.time()) < 60
