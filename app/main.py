"""Entry point of the desktop app: `flotilla` with no subcommand lands here
through the "flotilla.gui" entry point (engine never imports app).

    python -m app.main [--model demo] [--device CPU]
"""

from __future__ import annotations

import argparse
import os
import sys

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app import style
from app.gui_gc import GuiThreadCollector


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="flotilla", description="Flotilla desktop app")
    parser.add_argument("--model", default=None,
                        help="demo id, model folder or hub id (default: the last one used, "
                             "demo on a first start)")
    parser.add_argument("--device", default="CPU", help="OpenVINO device (default: CPU)")
    # Whatever we do not know (-platform, -style...) is for Qt.
    return parser.parse_known_args(argv)


def _qt_binding_is_broken() -> bool:
    """True if this PySide6 build drops a reference to None on every void
    call. PySide6 6.12.0 does so on CPython < 3.12 (where None is not yet
    immortal): the app would die with "Fatal Python error: none_dealloc" after
    a few thousand calls. Better one clear message at startup."""
    if sys.version_info >= (3, 12):
        return False  # None is immortal there: the bug is harmless
    timer = QTimer()
    before = sys.getrefcount(None)
    for _ in range(32):
        timer.setInterval(1)
    return sys.getrefcount(None) < before - 16


def _display_available(qt_args: list[str]) -> bool:
    """On Linux/BSD, Qt aborts the process with a long message when no display
    is reachable; say it in one line instead. Windows and macOS always have one."""
    if not sys.platform.startswith(("linux", "freebsd")):
        return True
    if "-platform" in qt_args or os.environ.get("QT_QPA_PLATFORM"):
        return True  # the user chose a platform plugin (offscreen, vnc, ...)
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def folders() -> tuple:
    """(settings folder, history folder): $FLOTILLA_DATA, else the folder chosen
    in Settings, else the platform's (engine/paths.py)."""
    from pathlib import Path

    from app.settings import AppSettings
    from engine import client

    config = client.settings_dir()
    chosen = AppSettings.load(config).data_folder
    if chosen and not os.environ.get("FLOTILLA_DATA"):
        data = Path(chosen)
        data.mkdir(parents=True, exist_ok=True)
    else:
        data = client.data_dir()
    return config, data


def create_window(model: str | None = None, device: str = "CPU", open_engine: bool = True):
    from app.main_window import MainWindow

    config, data = folders()
    return MainWindow(config, data, model, device, open_engine)


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, qt_args = _parse(argv)
    if not _display_available(qt_args):
        print("flotilla: error: no display found (DISPLAY and WAYLAND_DISPLAY are unset); "
              "start the app from a desktop session, or use `flotilla chat` / `flotilla serve` "
              "in a terminal", file=sys.stderr)
        return 1
    app = QApplication.instance() or QApplication([sys.argv[0], *qt_args])
    app.setApplicationName("Flotilla")
    app.setApplicationDisplayName("Flotilla")
    app.setDesktopFileName("flotilla")  # matches installers/linux .desktop (taskbar icon)
    app.setWindowIcon(style.app_icon())
    app.setStyle("Fusion")  # the same look on Windows, Linux and macOS
    app.setStyleSheet(style.STYLESHEET)

    if _qt_binding_is_broken():
        import PySide6

        print(f"flotilla: PySide6 {PySide6.__version__} is broken on Python "
              f"{sys.version_info.major}.{sys.version_info.minor} (it leaks references to "
              "None and would crash); use Python 3.12+ or PySide6-Essentials 6.11.", file=sys.stderr)
        return 2

    collector = GuiThreadCollector(app)  # cycles holding Qt objects die on this thread only
    collector.start()
    window = create_window(args.model, args.device)
    window.show()
    code = app.exec()
    # closeEvent already waited for the engine to close; this only catches a
    # job still returning after the grace timeout.
    window.runner.wait_for_done(2000)
    collector.stop()
    return code


if __name__ == "__main__":
    sys.exit(run())
