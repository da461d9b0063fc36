"""What the installers need to know about the project, read from pyproject.toml.

The version, the console scripts and the `flotilla.gui` entry point live in
pyproject.toml only; every recipe (PyInstaller spec, .deb control file, Inno
Setup defines, macOS Info.plist, CI) takes them from here, never a copy.

    python -m installers.project version        # 0.1.0
    python -m installers.project json           # everything, for CI scripts
    python -m installers.project dist-requirements   # the `dist` extra (build tools)
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTALLERS = REPO / "installers"
ICONS = REPO / "assets" / "icons"

# Names shared by every OS's recipe (not facts of pyproject: packaging choices).
APP_NAME = "Flotilla"  # what users see: menus, window titles, the .app
BUNDLE_ID = "org.flotilla.Flotilla"  # macOS bundle id; reverse-DNS base of the agent's LaunchAgent
AGENT_ID = "org.flotilla.agent"  # macOS LaunchAgent label, Windows Run value base
AGENT_BUNDLE_ID = "org.flotilla.Flotilla.Agent"  # macOS: the agent's own helper bundle (installers/macapp.py)
AGENT_APP_NAME = "Flotilla Agent"  # macOS: that helper's name (Flotilla.app/Contents/Helpers/Flotilla Agent.app)
APP_ICON = "flotilla.svg"  # in assets/icons
TRAY_ICON_PREFIX = "tray-"  # tray state icons: assets/icons/tray-*.svg
AGENT_EXE = "flotilla-agent"  # the agent's executable = the CLI entry point + AGENT_ARGV
AGENT_ARGV = ("agent",)

# Fleet ports, as docs/fleet.md and engine/fleet/discovery.py define them (a
# test checks they still agree): control, pairing = +1, info = +2, all TCP.
AGENT_BASE_PORT = 47600
AGENT_TCP_PORTS = (AGENT_BASE_PORT, AGENT_BASE_PORT + 1, AGENT_BASE_PORT + 2)
MDNS_UDP_PORT = 5353


@dataclass(frozen=True)
class Project:
    name: str  # distribution name ("flotilla"): the dist-info the bundle carries
    version: str  # [project].version
    description: str  # one line, for package managers
    license: str  # SPDX-ish text from [project].license
    scripts: dict[str, str] = field(default_factory=dict)  # console script -> "module:function"
    gui_entry_points: dict[str, str] = field(default_factory=dict)  # [project.entry-points."flotilla.gui"]
    entry_points: dict[str, dict[str, str]] = field(default_factory=dict)  # every other group

    @property
    def cli_script(self) -> str:
        """The console script the bundle's `flotilla` executable runs."""
        return self.name if self.name in self.scripts else next(iter(self.scripts))

    @property
    def numeric_version(self) -> str:
        """x.y.z from the version's leading numbers, as Windows VERSIONINFO and
        CFBundleVersion want ("1.2.0rc1" -> "1.2.0")."""
        nums = re.match(r"\d+(?:\.\d+){0,2}", self.version)
        parts = nums.group(0).split(".") if nums else ["0"]
        return ".".join(parts + ["0"] * (3 - len(parts)))


def load(pyproject: Path | None = None) -> Project:
    data = tomllib.loads((pyproject or REPO / "pyproject.toml").read_text(encoding="utf-8"))
    proj = data["project"]
    if "version" not in proj:
        raise SystemExit("installers: pyproject.toml has no static [project].version")
    eps = {group: dict(items) for group, items in proj.get("entry-points", {}).items()}
    lic = proj.get("license", "")
    return Project(
        name=proj["name"],
        version=proj["version"],
        description=proj.get("description", ""),
        license=lic.get("text", "") if isinstance(lic, dict) else str(lic),
        scripts=dict(proj.get("scripts", {})),
        gui_entry_points=eps.pop("flotilla.gui", {}),
        entry_points=eps,
    )


def dist_info_files(project: Project) -> dict[str, str]:
    """The files of a minimal `<name>-<version>.dist-info`, so that in the frozen
    bundle importlib.metadata finds the version (engine.__version__) and the
    `flotilla.gui` entry point (engine/cli/main.py opens the app through it),
    exactly as a pip install would."""
    groups = {"console_scripts": project.scripts, "flotilla.gui": project.gui_entry_points,
              **project.entry_points}
    ep_lines: list[str] = []
    for group, items in groups.items():
        if items:
            ep_lines.append(f"[{group}]")
            ep_lines += [f"{k} = {v}" for k, v in items.items()]
            ep_lines.append("")
    meta = (f"Metadata-Version: 2.1\nName: {project.name}\nVersion: {project.version}\n"
            f"Summary: {project.description}\nLicense: {project.license}\n")
    return {"METADATA": meta, "entry_points.txt": "\n".join(ep_lines),
            "top_level.txt": "app\nengine\n", "INSTALLER": "flotilla-installers\n"}


def write_dist_info(project: Project, dest: Path) -> Path:
    folder = dest / f"{project.name}-{project.version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in dist_info_files(project).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def icon_paths() -> dict[str, Path]:
    """The app icon and the tray state icons the installers ship."""
    out = {"app": ICONS / APP_ICON}
    out.update({p.stem: p for p in sorted(ICONS.glob(f"{TRAY_ICON_PREFIX}*.svg"))})
    return out


if __name__ == "__main__":
    p = load()
    what = sys.argv[1] if len(sys.argv) > 1 else "json"
    if what == "version":
        print(p.version)
    elif what == "numeric-version":
        print(p.numeric_version)
    elif what == "dist-requirements":  # what `make dist` installs to build (the `dist` extra)
        data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
        print(" ".join(data["project"].get("optional-dependencies", {}).get("dist", ["pyinstaller"])))
    else:
        print(json.dumps({**asdict(p), "numeric_version": p.numeric_version, "app_name": APP_NAME,
                          "bundle_id": BUNDLE_ID, "agent_exe": AGENT_EXE,
                          "agent_tcp_ports": AGENT_TCP_PORTS, "mdns_udp_port": MDNS_UDP_PORT}, indent=2))
