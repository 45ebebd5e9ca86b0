"""Platform selection: entry-point discovery, the override, priorities, ties, unregistering
losers, and messages that name what detection found."""

from __future__ import annotations

import subprocess
import sys
import types

import pluggy
import pytest

import octavo
from octavo.errors import PlatformError
from octavo.platform import PLATFORM_ENV, Platform, PlatformInfo, create_plugin_manager
from octavo.platform.manager import plugin_records
from octavo.platform.selection import choose_platform, detect_platforms


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    monkeypatch.delenv("OCTAVO_EXAMPLE_NPU", raising=False)


def fake_platform(name: str, priority: int, available: bool = True) -> types.SimpleNamespace:
    """An in-process platform plugin that only detects."""

    @octavo.hookimpl
    def octavo_platform_detect():
        return PlatformInfo(name, "cpu", available, priority, f"fake {name}")

    return types.SimpleNamespace(octavo_platform_detect=octavo_platform_detect)


def test_builtin_and_example_platforms_are_found_through_entry_points():
    pm = create_plugin_manager()
    records = plugin_records(pm)
    names = {d.info.name for d in detect_platforms(pm)}
    assert {"cpu", "cuda", "rocm", "tpu", "example"} <= names
    # The example plugin is installed as a distribution of its own, as a vendor's would be.
    assert records["example"].dist_name == "octavo-example-platform"
    assert records["cpu"].dist_name == "octavo-cpu"


def test_a_platform_that_fails_to_import_is_reported_and_the_others_load(tmp_path, monkeypatch):
    """An installed platform package whose module raises on import (a broken vendor package)
    stands in as unavailable, with the error as its reason; every other plugin still loads."""
    (tmp_path / "broken_npu_plugin.py").write_text("raise ImportError('libnpu.so not found')\n")
    dist_info = tmp_path / "broken_npu-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-npu\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[octavo.platforms]\nbroken = broken_npu_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_plugin_manager()
    found = {d.info.name: d.info for d in detect_platforms(pm)}
    assert {"cpu", "cuda", "rocm", "tpu", "example", "broken"} <= set(found)
    assert not found["broken"].available
    assert "libnpu.so not found" in found["broken"].reason
    assert Platform.select().name == "cpu"


def test_cpu_is_chosen_by_default_on_a_machine_without_accelerators():
    platform = Platform.select()
    assert platform.name == "cpu"
    assert platform.device_init().type == "cpu"


def test_example_is_selected_with_device_flag_when_present(monkeypatch):
    monkeypatch.setenv("OCTAVO_EXAMPLE_NPU", "1")
    platform = Platform.select(device="example")
    assert platform.name == "example"
    assert platform.device_init().type == "cpu"  # the example NPU is emulated on the host
    assert platform.capabilities.block_sizes == (1, 16, 32, 128)


def test_environment_variable_forces_a_platform(monkeypatch):
    monkeypatch.setenv("OCTAVO_EXAMPLE_NPU", "1")
    monkeypatch.setenv(PLATFORM_ENV, "cpu")
    selection = choose_platform(detect_platforms(create_plugin_manager()))
    assert selection.chosen.info.name == "cpu"
    assert PLATFORM_ENV in selection.why


def test_present_vendor_platform_outranks_cpu(monkeypatch):
    monkeypatch.setenv("OCTAVO_EXAMPLE_NPU", "1")
    assert Platform.select().name == "example"


@pytest.mark.parametrize("name", ["example", "cuda", "rocm", "tpu"])
def test_forcing_an_unavailable_platform_fails_with_its_reason(name):
    pm = create_plugin_manager()
    reason = next(d.info.reason for d in detect_platforms(pm) if d.info.name == name)
    with pytest.raises(PlatformError, match="not available") as excinfo:
        Platform.select(device=name, pm=pm)
    assert reason in str(excinfo.value)


def test_forcing_an_unknown_platform_lists_the_installed_ones():
    with pytest.raises(PlatformError, match="no installed plugin provides it.*cpu"):
        Platform.select(device="quantum")


def test_a_tie_is_an_error_naming_both():
    pm = create_plugin_manager(
        plugins=[("alpha", fake_platform("alpha", 50)), ("beta", fake_platform("beta", 50))]
    )
    with pytest.raises(PlatformError, match="'alpha' and 'beta'|'beta' and 'alpha'"):
        Platform.select(pm=pm)


def test_no_available_platform_says_what_was_detected():
    unavailable = [("x", fake_platform("x", 5, False))]
    pm = create_plugin_manager(load_entry_points=False, plugins=unavailable)
    with pytest.raises(PlatformError, match="no platform is available .detected: x: fake x.") as e:
        choose_platform(detect_platforms(pm))
    assert "octavo-cpu" in str(e.value)


def test_messages_suggest_the_other_platforms_detection_found():
    from octavo_cpu import plugin as cpu_plugin

    others = [("alpha", fake_platform("alpha", -1)), ("gone", fake_platform("gone", 9, False))]
    pm = create_plugin_manager(load_entry_points=False, plugins=[("cpu", cpu_plugin), *others])
    platform = Platform.select(pm=pm)
    assert platform.name == "cpu" and platform.others_available() == ["alpha"]
    assert "--device (alpha available here)" in platform.choose_another()
    pm = create_plugin_manager(load_entry_points=False, plugins=[("cpu", cpu_plugin)])
    alone = Platform.select(pm=pm)
    assert alone.others_available() == [] and "octavo env" in alone.choose_another()


def test_a_broken_detection_is_reported_not_fatal():
    @octavo.hookimpl
    def octavo_platform_detect():
        raise RuntimeError("driver exploded")

    pm = create_plugin_manager(
        plugins=[("broken", types.SimpleNamespace(octavo_platform_detect=octavo_platform_detect))]
    )
    broken = next(d for d in detect_platforms(pm) if d.plugin_name == "broken")
    assert not broken.info.available and "driver exploded" in broken.info.reason
    assert Platform.select(pm=pm).name == "cpu"


def install_entry_point(root, group: str, name: str, module_source: str) -> None:
    """A distribution on ``root`` (to be put on sys.path) whose ``group`` entry point ``name``
    is a module with the given source: what `pip install` of a vendor package leaves behind."""
    dist = root / f"octavo_{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: octavo-{name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = octavo_{name}_plugin\n")
    (root / f"octavo_{name}_plugin.py").write_text(module_source)


def test_a_platform_plugin_that_fails_to_import_is_reported_not_fatal(tmp_path, monkeypatch):
    install_entry_point(
        tmp_path,
        "octavo.platforms",
        "brokenvendor",
        "raise ImportError('libvendorrt.so.3: cannot open shared object file')\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_plugin_manager()
    broken = next(d for d in detect_platforms(pm) if d.plugin_name == "brokenvendor")
    assert not broken.info.available and "libvendorrt.so.3" in broken.info.reason
    with pytest.raises(PlatformError, match="libvendorrt.so.3"):
        Platform.select(device="brokenvendor", pm=create_plugin_manager())
    assert Platform.select(pm=pm).name == "cpu"


def test_an_extension_plugin_that_fails_to_import_is_skipped_and_logged(
    tmp_path, monkeypatch, caplog
):
    install_entry_point(
        tmp_path, "octavo.plugins", "brokenext", "raise RuntimeError('bad kernels')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_plugin_manager()
    assert pm.get_plugin("brokenext") is None and pm.get_plugin("cpu") is not None
    assert "bad kernels" in caplog.text
    assert Platform.select(pm=pm).name == "cpu"


def test_losing_platform_plugins_are_unregistered_before_kernel_hooks(monkeypatch):
    monkeypatch.setenv("OCTAVO_EXAMPLE_NPU", "1")
    platform = Platform.select(device="cpu")
    remaining = {name for name, _ in platform.pm.list_name_plugin()}
    assert "cpu" in remaining
    assert not {"example", "cuda", "rocm", "tpu"} & remaining
    assert "octavo-models" in remaining  # non-platform plugins stay


def test_a_misspelled_hookimpl_is_rejected():
    @octavo.hookimpl
    def octavo_rms_nrom(platform, hidden_size, eps, dtype):
        return None

    with pytest.raises(pluggy.PluginValidationError, match="octavo_rms_nrom"):
        create_plugin_manager(
            plugins=[("typo", types.SimpleNamespace(octavo_rms_nrom=octavo_rms_nrom))]
        )


def test_an_implementation_with_an_unknown_argument_is_rejected():
    @octavo.hookimpl
    def octavo_sampler(platform, vocab_size, temperature):
        return None

    with pytest.raises(pluggy.PluginValidationError, match="temperature"):
        create_plugin_manager(
            plugins=[("bad", types.SimpleNamespace(octavo_sampler=octavo_sampler))]
        )


def test_loading_the_gpu_plugins_imports_no_kernels():
    """Start-up on a host without their GPUs: loading and detecting every installed platform
    imports neither Triton nor the Triton platforms' kernel modules (their kernel hooks import
    them once the platform is chosen). A fresh interpreter, so nothing else imported them first."""
    if not {"cuda", "rocm"} & set(plugin_records(create_plugin_manager())):
        pytest.skip("the Triton GPU platforms are not installed")
    code = (
        "import sys\n"
        "from octavo.platform import create_plugin_manager\n"
        "from octavo.platform.selection import detect_platforms\n"
        "detect_platforms(create_plugin_manager())\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
        "'octavo_triton.attention', 'octavo_triton.sampler', 'octavo_rocm.rms_norm'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
