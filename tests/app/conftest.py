"""Qt tests run headless. This must happen before anything imports Qt, and
conftest files load before the test modules that do."""

from __future__ import annotations

import os

# Force offscreen even if the shell exports xcb: tests must not need a display.
# FLOTILLA_TEST_QPA=xcb lets a developer watch the tests under a real display.
os.environ["QT_QPA_PLATFORM"] = os.environ.get("FLOTILLA_TEST_QPA", "offscreen")
