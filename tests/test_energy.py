"""Energy over the timed window: RAPL read from a fake sysfs (wraparound, zones that must not count,
paused time), NVML from a fake library (a GPU without the counter empties the column)."""
import pytest
import torch

from common.measure import energy as energy_mod
from common.measure.energy import Energy, rapl_zones


def zone(root, name, label, energy, span=1_000_000):
    path = root / name
    path.mkdir()
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy}\n")
    (path / "max_energy_range_uj").write_text(f"{span}\n")
    return path


def test_rapl_counts_packages_across_a_wrap_and_not_while_paused(tmp_path):
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 900_000)
    zone(tmp_path, "intel-rapl:0:0", "core", 5)  # inside the package already
    zone(tmp_path, "intel-rapl:1", "psys", 7)  # the whole platform, packages included
    assert rapl_zones(str(tmp_path)) == [str(pkg)]
    e = Energy([torch.device("cpu")], torch.device("cpu"), batch_size=4, rapl_root=str(tmp_path), poll_s=0)
    e.start()
    (pkg / "energy_uj").write_text("100000\n")  # wrapped at 1 J: 0.2 J spent
    e.step()
    e.pause()
    (pkg / "energy_uj").write_text("600000\n")  # checkpoint save: not the window's
    e.resume()
    (pkg / "energy_uj").write_text("700000\n")
    e.step()
    e.pause()  # the last epoch's end; then evaluation, before the window is closed
    (pkg / "energy_uj").write_text("950000\n")
    e.stop()
    assert e.row() == {"energy_j": pytest.approx(0.3), "img_per_j": pytest.approx(8 / 0.3, rel=1e-3)}


def test_no_readable_package_leaves_the_columns_empty(tmp_path):
    zone(tmp_path, "intel-rapl:0", "package-0", 1).joinpath("energy_uj").unlink()  # as if root-only (Linux 5.10+)
    zone(tmp_path, "intel-rapl:1", "psys", 7)
    e = Energy([torch.device("cpu")], torch.device("cpu"), batch_size=4, rapl_root=str(tmp_path))
    e.start()
    e.step()
    e.stop()
    assert e.row() == {"energy_j": None, "img_per_j": None}


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, supported):
        self.supported, self.mj = supported, {0: 1_000, 1: 5_000}

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.supported[handle]:
            raise self.NVMLError("Not Supported")
        return self.mj[handle]


@pytest.mark.parametrize("supported, joules", [((True, True), 2 * 3.0), ((True, False), None)])
def test_nvml_energy_sums_the_gpus_and_needs_every_one(monkeypatch, supported, joules):
    lib = FakeNvml(supported)
    monkeypatch.setattr(energy_mod, "nvml_handle", lambda d: (lib, d.index))
    e = Energy([torch.device("cuda", 0), torch.device("cuda", 1)], torch.device("cpu"), batch_size=2)
    e.start()
    lib.mj = {0: 4_000, 1: 8_000}  # 3 J each
    e.step()
    e.stop()
    row = e.row()
    assert row["energy_j"] == (None if joules is None else pytest.approx(joules))
    assert row["img_per_j"] == (None if joules is None else pytest.approx(2 / joules, rel=1e-3))


def test_energy_without_nvml_is_empty(monkeypatch):
    monkeypatch.setattr(energy_mod, "nvml_handle", lambda d: (None, None))
    e = Energy([torch.device("cuda", 0)], torch.device("cpu"), batch_size=2)
    e.start()
    e.stop()
    assert e.row() == {"energy_j": None, "img_per_j": None}


def test_fake_nvml_module_shape():
    """The fake has the calls the counter makes on the real pynvml."""
    import pynvml

    for name in ("nvmlDeviceGetTotalEnergyConsumption", "NVMLError"):
        assert hasattr(pynvml, name) and hasattr(FakeNvml, name)
    assert issubclass(pynvml.NVMLError_NotSupported, pynvml.NVMLError)
