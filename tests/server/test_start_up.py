"""Start-up runs without the cyclic garbage collector; what it built is frozen afterwards."""

from __future__ import annotations

import gc
import subprocess
import sys

from octavo.entrypoints.start_up import collection_paused


def test_the_collector_is_off_inside_and_back_on_after_with_the_start_up_frozen():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with collection_paused():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]  # what start-up builds: objects that stay
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()  # leave the test process as it was


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_server_command_starts_with_its_imports_frozen():
    """``octavo`` (any command) parses its arguments, which imports the subcommands' modules,
    with the collector paused: those modules end up frozen."""
    code = (
        "import gc, sys\n"
        "from octavo.cli import main\n"
        "try:\n"
        "    main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 10000, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-3:] == ["True", "True", "True"]
