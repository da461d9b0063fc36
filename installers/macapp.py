"""Flotilla.app on macOS: the app's Info.plist, and the tray agent as its own helper bundle.

Why a helper bundle: macOS tells apps apart by the bundle their executable sits in. An agent
executable inside Flotilla.app/Contents/MacOS *is* Flotilla.app to the system (same bundle id,
same Local Network permission, and a Dock icon as soon as its tray starts Qt). So the agent
gets its own bundle, nested where macOS expects helpers, with its own id and LSUIElement (a
menu-bar-only app: no Dock icon, no app menu):

    Flotilla.app/Contents/
      Info.plist                       app_info_plist(): org.flotilla.Flotilla
      MacOS/FlotillaApp, MacOS/flotilla
      Frameworks -> Helpers/Flotilla Agent.app/Contents/Frameworks     (relative symlinks)
      Resources  -> Helpers/Flotilla Agent.app/Contents/Resources
      Helpers/Flotilla Agent.app/Contents/
        Info.plist                     agent_info_plist(): org.flotilla.Flotilla.Agent, LSUIElement
        MacOS/flotilla-agent           (moved here from Flotilla.app/Contents/MacOS)
        Frameworks/, Resources/        the one copy of the frozen Python, libraries and data

One copy of the ~GB payload, not two. It lives in the nested bundle, and the outer bundle links
to it, because a symlink must point inside the bundle that holds it for codesign: the outer
bundle's links point into its own Helpers folder (valid), while links from the helper out to
the outer bundle would not be. PyInstaller's bootloader finds its files at
<executable>/../Frameworks in every executable of either bundle, through the links for the
outer ones. The relative links that PyInstaller made between Frameworks and Resources move
with them, so they stay valid.

make_helper(app) turns the .app PyInstaller built (installers/flotilla.spec) into that layout;
installers/build.py calls it on macOS, installers/macos/make_dmg.sh checks it before signing.
The LaunchAgent (installers/autostart.py) starts the helper's executable. Standard library only.
"""

from __future__ import annotations

import os
import plistlib
import shutil
from pathlib import Path

from installers import project as P

HELPERS = "Helpers"  # Contents/Helpers: where macOS expects nested helper apps
AGENT_APP = f"{P.AGENT_APP_NAME}.app"  # "Flotilla Agent.app"
MOVED = ("Frameworks", "Resources")  # the payload the outer bundle links to
MIN_MACOS = "12.0"
LOCAL_NETWORK = "Flotilla finds and uses the idle PCs of your local network."
BONJOUR = ["_flotilla._tcp"]
ICON = "flotilla.icns"  # installers/icons.py; PyInstaller copies it into Contents/Resources


def app_info_plist(proj: P.Project) -> dict:
    """The desktop app's Info.plist keys (PyInstaller's BUNDLE adds the rest)."""
    return {
        "CFBundleName": P.APP_NAME,
        "CFBundleDisplayName": P.APP_NAME,
        "CFBundleShortVersionString": proj.version,
        "CFBundleVersion": proj.numeric_version,
        "LSMinimumSystemVersion": MIN_MACOS,
        "NSHighResolutionCapable": True,
        # mDNS browsing of _flotilla._tcp on the LAN (macOS 11+ asks the user once per app).
        "NSLocalNetworkUsageDescription": LOCAL_NETWORK,
        "NSBonjourServices": BONJOUR,
    }


def agent_info_plist(proj: P.Project) -> dict:
    """The agent helper's complete Info.plist."""
    return {
        "CFBundleInfoDictionaryVersion": "6.0",
        "CFBundlePackageType": "APPL",
        "CFBundleIdentifier": P.AGENT_BUNDLE_ID,
        "CFBundleName": P.AGENT_APP_NAME,
        "CFBundleDisplayName": P.AGENT_APP_NAME,
        "CFBundleExecutable": P.AGENT_EXE,
        "CFBundleIconFile": ICON,
        "CFBundleShortVersionString": proj.version,
        "CFBundleVersion": proj.numeric_version,
        "LSMinimumSystemVersion": MIN_MACOS,
        "NSHighResolutionCapable": True,
        # A menu-bar (tray) app: no Dock icon, no app menu. Qt reads this key of the main
        # bundle and then leaves the process an accessory instead of a foreground app.
        "LSUIElement": True,
        # The agent announces itself over mDNS and serves the fleet: its own permission prompt.
        "NSLocalNetworkUsageDescription": LOCAL_NETWORK,
        "NSBonjourServices": BONJOUR,
    }


def helper_path(app: Path) -> Path:
    return Path(app) / "Contents" / HELPERS / AGENT_APP


def agent_executable(app: Path) -> Path:
    """The agent's executable inside an installed Flotilla.app."""
    return helper_path(app) / "Contents" / "MacOS" / P.AGENT_EXE


def make_helper(app: Path, proj: P.Project) -> Path:
    """Restructure a PyInstaller-built Flotilla.app into the layout of the module docstring;
    returns the helper bundle. Idempotent (a second call checks and returns)."""
    app = Path(app)
    contents = app / "Contents"
    helper = helper_path(app)
    hc = helper / "Contents"
    if (hc / "MacOS" / P.AGENT_EXE).is_file() and all((contents / d).is_symlink() for d in MOVED):
        return helper
    exe = contents / "MacOS" / P.AGENT_EXE
    if not exe.is_file():
        raise FileNotFoundError(f"{exe}: the spec did not build the agent executable")
    (hc / "MacOS").mkdir(parents=True, exist_ok=True)
    os.replace(exe, hc / "MacOS" / P.AGENT_EXE)
    for name in MOVED:
        src = contents / name
        if src.is_symlink():
            continue
        if not src.is_dir():
            raise FileNotFoundError(f"{src}: not a PyInstaller .app (no Contents/{name})")
        shutil.move(str(src), str(hc / name))
        # Relative, inside the outer bundle: Contents/Frameworks -> Helpers/<agent>.app/Contents/Frameworks
        os.symlink(os.path.relpath(hc / name, contents), src, target_is_directory=True)
    (hc / "Info.plist").write_bytes(plistlib.dumps(agent_info_plist(proj)))
    (hc / "PkgInfo").write_text("APPL????", encoding="ascii")
    return helper


def check_layout(app: Path) -> list[str]:
    """What is wrong with an assembled Flotilla.app (empty when it is right)."""
    app = Path(app)
    contents, hc = app / "Contents", helper_path(app) / "Contents"
    problems = []
    if not (hc / "MacOS" / P.AGENT_EXE).is_file():
        problems.append("no agent executable in the helper")
    if (contents / "MacOS" / P.AGENT_EXE).exists():
        problems.append("an agent executable left in the app's own MacOS folder")
    for name in MOVED:
        link = contents / name
        if not link.is_symlink() or Path(os.path.realpath(link)) != Path(os.path.realpath(hc / name)):
            problems.append(f"Contents/{name} does not link to the helper's")
        elif os.path.isabs(os.readlink(link)):
            problems.append(f"Contents/{name} is an absolute link (breaks once the app is moved)")
    try:
        plist = plistlib.loads((hc / "Info.plist").read_bytes())
    except (OSError, plistlib.InvalidFileException):
        problems.append("the helper has no readable Info.plist")
    else:
        if plist.get("CFBundleIdentifier") != P.AGENT_BUNDLE_ID or plist.get("LSUIElement") is not True:
            problems.append("the helper's Info.plist lacks its own bundle id or LSUIElement")
    return problems


def main(argv: list[str] | None = None) -> int:
    """python -m installers.macapp check PATH/TO/Flotilla.app  (make_dmg.sh runs it)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("check", "make"):
        print("usage: python -m installers.macapp check|make Flotilla.app", file=sys.stderr)
        return 2
    if argv[0] == "make":
        print(make_helper(Path(argv[1]), P.load()))
        return 0
    problems = check_layout(Path(argv[1]))
    for p in problems:
        print(f"{argv[1]}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
