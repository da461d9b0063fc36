"""Start the tray agent at login: opt-in, per user, on Linux, macOS and Windows.

The hook the desktop app calls (first start: "Lend this PC to your fleet when
it is idle: start the Flotilla agent when I log in?"; Settings: the same
checkbox):

    from installers import autostart          # bundled in every installer
    autostart.is_enabled() -> bool
    autostart.enable(start_now=False) -> str  # where the entry was written
    autostart.disable() -> bool               # True if an entry was removed

Per OS (all per user, no admin rights needed, removed by disable()):
  Linux    $XDG_CONFIG_HOME/autostart/flotilla-agent.desktop (XDG autostart),
           from installers/linux/flotilla-agent-autostart.desktop. Its TryExec
           makes a stale entry harmless once the package is removed.
  macOS    ~/Library/LaunchAgents/org.flotilla.agent.plist (a LaunchAgent),
           from installers/macos/org.flotilla.agent.plist; start_now loads it
           with launchctl. It starts the agent of the helper bundle inside the
           app (Flotilla.app/Contents/Helpers/Flotilla Agent.app: its own bundle
           id and no Dock icon, installers/macapp.py), at full speed
           (ProcessType Interactive, not Background).
  Windows  HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run, value
           "FlotillaAgent" (Setup.exe's "start the agent at every login" task
           writes the same value under HKLM, for all users; is_enabled() sees
           both, disable() removes the per-user one; the uninstaller both).

The agent command is the bundle's `flotilla-agent` when frozen (next to the
running executable; on macOS the helper bundle's), else `python -m
engine.cli.agent_cmd` of this interpreter. Standard library only. From a shell:
    flotilla -m installers.autostart enable|disable|status   (installed bundle)
    python -m installers.autostart enable|disable|status     (checkout)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
LINUX_TEMPLATE = HERE / "linux" / "flotilla-agent-autostart.desktop"
MAC_TEMPLATE = HERE / "macos" / "org.flotilla.agent.plist"
MAC_LABEL = "org.flotilla.agent"  # = installers.project.AGENT_ID
WIN_RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
WIN_RUN_VALUE = "FlotillaAgent"  # = installers/windows/flotilla.iss [Registry]
AGENT_EXE = "flotilla-agent"  # = installers.project.AGENT_EXE
MAC_AGENT_APP = "Flotilla Agent.app"  # = installers.macapp.AGENT_APP (Contents/Helpers of Flotilla.app)


def agent_command(platform: str | None = None) -> list[str]:
    """argv that starts the tray agent from this install."""
    platform = platform or sys.platform
    if getattr(sys, "frozen", False):
        exe = Path(sys.executable).resolve()
        if platform == "darwin":
            return [str(mac_agent_executable(exe))]
        name = AGENT_EXE + (".exe" if platform == "win32" else "")
        return [str(exe.parent / name)]
    return [sys.executable, "-m", "engine.cli.agent_cmd"]


def mac_agent_executable(exe: Path) -> Path:
    """The helper bundle's agent, from any executable of Flotilla.app: one in
    Flotilla.app/Contents/MacOS, or the agent itself."""
    if exe.name == AGENT_EXE:
        return exe
    contents = exe.parent.parent  # Flotilla.app/Contents
    return contents / "Helpers" / MAC_AGENT_APP / "Contents" / "MacOS" / AGENT_EXE


def _linux_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "autostart" / f"{AGENT_EXE}.desktop"


def _mac_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{MAC_LABEL}.plist"


def entry_path(platform: str | None = None) -> str:
    """Where the autostart entry lives (a file, or the registry value on Windows)."""
    platform = platform or sys.platform
    if platform == "win32":
        return f"HKCU\\{WIN_RUN_KEY}\\{WIN_RUN_VALUE}"
    return str(_mac_path() if platform == "darwin" else _linux_path())


def linux_entry(command: list[str]) -> str:
    """The XDG autostart .desktop text for this agent command."""
    exec_line = " ".join(_desktop_quote(a) for a in command)
    out = []
    for line in LINUX_TEMPLATE.read_text(encoding="utf-8").splitlines():
        if line.startswith("Exec="):
            line = f"Exec={exec_line}"
        elif line.startswith("TryExec="):
            line = f"TryExec={command[0]}"
        out.append(line)
    return "\n".join(out) + "\n"


def mac_entry(command: list[str]) -> str:
    """The LaunchAgent plist text for this agent command."""
    args = "\n".join(f"        <string>{escape(a)}</string>" for a in command)
    text = MAC_TEMPLATE.read_text(encoding="utf-8")
    start, end = text.index("<!--ARGS-->"), text.index("<!--/ARGS-->") + len("<!--/ARGS-->")
    return text[:start] + args.lstrip() + text[end:]


def windows_entry(command: list[str]) -> str:
    """The Run value's data: a command line."""
    return subprocess.list2cmdline(command)


def _desktop_quote(arg: str) -> str:
    # Desktop Entry Spec: quote arguments with reserved characters; escape " ` $ \.
    if arg and not any(c in arg for c in " \t\n\"'\\><~|&;$*?#()`="):
        return arg
    return '"' + "".join("\\" + c if c in '"`$\\' else c for c in arg) + '"'


def is_enabled(platform: str | None = None) -> bool:
    platform = platform or sys.platform
    if platform == "win32":
        return _win_get() is not None
    return Path(entry_path(platform)).exists()


def enable(command: list[str] | None = None, start_now: bool = False, platform: str | None = None) -> str:
    """Start the agent at every login of this user from now on; returns entry_path().
    start_now also starts it for this session (macOS via launchctl, Windows and
    Linux as a detached process)."""
    platform = platform or sys.platform
    command = command or agent_command(platform)
    where = entry_path(platform)
    if platform == "win32":
        _win_set(windows_entry(command))
    else:
        path = Path(where)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = mac_entry(command) if platform == "darwin" else linux_entry(command)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    if start_now:
        _start(command, platform, where)
    return where


def disable(platform: str | None = None) -> bool:
    """Stop starting the agent at login (a running agent keeps running)."""
    platform = platform or sys.platform
    if platform == "win32":
        return _win_delete()
    path = Path(entry_path(platform))
    if platform == "darwin" and path.exists():
        _launchctl("bootout", str(path))
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _start(command: list[str], platform: str, where: str) -> None:
    if platform == "darwin":
        _launchctl("bootstrap", where)
        return
    kw: dict = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if platform == "win32":
        kw["creationflags"] = 0x00000008 | 0x00000200  # DETACHED_PROCESS | CREATE_NEW_PROCESS_GROUP
    else:
        kw["start_new_session"] = True
    subprocess.Popen(command, **kw)


def _launchctl(verb: str, plist: str) -> None:
    uid = os.getuid() if hasattr(os, "getuid") else 0  # no getuid on Windows (a test of the macOS files there)
    try:
        subprocess.run(["launchctl", verb, f"gui/{uid}", plist], capture_output=True, check=False)
    except OSError:  # not macOS (tests), or no launchctl: the file alone takes effect at next login
        pass


def _win_get() -> str | None:
    """The Run value of this user, else the machine-wide one Setup's
    "start the agent at every login" task writes (HKLM; disable() leaves that
    one to Setup/uninstall, as it needs admin rights)."""
    import winreg

    for hive in (winreg.HKEY_CURRENT_USER, winreg.HKEY_LOCAL_MACHINE):
        try:
            with winreg.OpenKey(hive, WIN_RUN_KEY) as key:
                return winreg.QueryValueEx(key, WIN_RUN_VALUE)[0]
        except FileNotFoundError:
            continue
    return None


def _win_set(value: str) -> None:
    import winreg

    with winreg.CreateKey(winreg.HKEY_CURRENT_USER, WIN_RUN_KEY) as key:
        winreg.SetValueEx(key, WIN_RUN_VALUE, 0, winreg.REG_SZ, value)


def _win_delete() -> bool:
    import winreg

    try:
        with winreg.OpenKey(winreg.HKEY_CURRENT_USER, WIN_RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
            winreg.DeleteValue(key, WIN_RUN_VALUE)
        return True
    except FileNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else "status"
    if what == "enable":
        print(f"the Flotilla agent starts at login: {enable(start_now='--now' in argv)}")
    elif what == "disable":
        print("autostart removed" if disable() else "autostart was not enabled")
    elif what == "status":
        state = "enabled" if is_enabled() else "disabled"
        print(f"{state}: {entry_path()} -> {shlex.join(agent_command())}")
    else:
        print("usage: autostart enable [--now] | disable | status", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
