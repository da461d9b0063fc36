"""Qt tests run headless, in a private config and data folder.

The environment must be set before anything imports Qt or reads a folder,
and conftest files load before the test modules that do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Force offscreen even if the shell exports xcb: tests must not need a display.
# FLOTILLA_TEST_QPA=xcb lets a developer watch the tests under a real display.
os.environ["QT_QPA_PLATFORM"] = os.environ.get("FLOTILLA_TEST_QPA", "offscreen")
# Conversations, settings, peers and the sharing policy of the tests never
# touch the user's own (FLOTILLA_DATA / FLOTILLA_CONFIG are read at use).
# Set per test module and restored afterwards: conftest files load for the
# whole session, and the other suites (fleet, e2e) must not see the app's
# paired keys or data folder.
_HOME = tempfile.mkdtemp(prefix="flotilla-apptest-")
atexit.register(shutil.rmtree, _HOME, True)  # the suite leaves nothing in the temp folder
_APP_ENV = {"FLOTILLA_DATA": os.path.join(_HOME, "data"), "FLOTILLA_CONFIG": os.path.join(_HOME, "config")}
# Fleet discovery of the app under test: mDNS on loopback only (nothing leaves
# the machine), as a user would set it in Settings.
os.makedirs(_APP_ENV["FLOTILLA_CONFIG"], exist_ok=True)
with open(os.path.join(_APP_ENV["FLOTILLA_CONFIG"], "app_settings.json"), "w", encoding="utf-8") as _f:
    _f.write('{"fleet_interfaces": "127.0.0.1"}')


@pytest.fixture(autouse=True, scope="module")
def _app_folders():
    """The app's private config and data folders, for the app's test modules only."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _APP_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(autouse=True)
def _collect_on_the_gui_thread(qapp):
    """As in the app (app/gui_gc.py): reference cycles holding Qt objects are collected on
    the GUI thread, at the end of each test at the latest, never on a job's thread."""
    from app.gui_gc import GuiThreadCollector

    collector = GuiThreadCollector()
    collector.start()
    yield
    collector.stop()
