"""The installer recipes agree with pyproject.toml and with each other.

Windows and macOS installers cannot be built on Linux CI; these checks keep
their recipes honest between CI runs on hosted runners: one version, one set
of entry points, icons that exist, the agent's ports as docs/fleet.md says,
every firewall rule added is removed on uninstall. Fast (no build).
"""

from __future__ import annotations

import configparser
import importlib.metadata
import plistlib
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from installers import autostart, bundle_rules, launcher  # noqa: E402
from installers import project as P  # noqa: E402

INST = REPO / "installers"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
ISS = (INST / "windows" / "flotilla.iss").read_text()
SPEC = (INST / "flotilla.spec").read_text()
WORKFLOW = REPO / ".github" / "workflows" / "installers.yml"


def test_project_reads_pyproject():
    proj = P.load()
    assert proj.version == PYPROJECT["version"]
    assert proj.scripts == PYPROJECT["scripts"]
    assert proj.gui_entry_points == PYPROJECT["entry-points"]["flotilla.gui"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", proj.numeric_version)
    assert proj.cli_script == "flotilla"


def test_generated_dist_info_is_what_importlib_metadata_reads(tmp_path):
    """The frozen bundle finds its version and the app through this dist-info."""
    proj = P.load()
    P.write_dist_info(proj, tmp_path)
    (dist,) = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert dist.metadata["Name"] == proj.name and dist.version == proj.version
    eps = dist.entry_points
    gui = {e.name: e.value for e in eps if e.group == "flotilla.gui"}
    scripts = {e.name: e.value for e in eps if e.group == "console_scripts"}
    assert gui == PYPROJECT["entry-points"]["flotilla.gui"]
    assert scripts == PYPROJECT["scripts"]


def test_no_recipe_duplicates_the_version_or_entry_points():
    version = re.escape(PYPROJECT["version"])
    targets = list(PYPROJECT["scripts"].values()) + list(PYPROJECT["entry-points"]["flotilla.gui"].values())
    recipes = [INST / "flotilla.spec", INST / "windows" / "flotilla.iss", INST / "macos" / "make_dmg.sh",
               INST / "macos" / "org.flotilla.agent.plist", INST / "linux" / "deb.py", WORKFLOW]
    for path in recipes:
        text = path.read_text()
        assert not re.search(rf"(?<![\d.]){version}(?![\d.])", text), f"{path.name} hard-codes the version"
        for target in targets:
            assert target not in text, f"{path.name} hard-codes the entry point {target}"
    assert "project.load(" in SPEC and "PROJ.scripts" in SPEC and "PROJ.gui_entry_points" in SPEC
    assert "#error" in ISS and "AppVersion={#AppVersion}" in ISS
    assert "installers.project version" in (INST / "macos" / "make_dmg.sh").read_text()


def test_icons_exist_and_are_svg():
    icons = P.icon_paths()
    assert icons["app"].name == P.APP_ICON
    tray = [k for k in icons if k.startswith(P.TRAY_ICON_PREFIX)]
    assert tray, "no tray state icons (assets/icons/tray-*.svg)"
    for path in icons.values():
        assert path.is_file(), path
        assert ET.parse(path).getroot().tag.endswith("svg"), path


def test_rendered_icons(tmp_path):
    pytest.importorskip("PySide6.QtSvg")
    from installers.icons import ICO_SIZES, PNG_SIZES, make_all

    out = make_all(tmp_path)
    ico = out["ico"].read_bytes()
    assert ico[:4] == b"\0\0\1\0" and int.from_bytes(ico[4:6], "little") == len(ICO_SIZES)
    icns = out["icns"].read_bytes()
    assert icns[:4] == b"icns" and int.from_bytes(icns[4:8], "big") == len(icns)
    for s in PNG_SIZES:
        png = out[f"png{s}"].read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(png[16:20], "big") == s  # IHDR width


def _desktop(path: Path) -> configparser.SectionProxy:
    cp = configparser.ConfigParser(interpolation=None, strict=True)
    cp.optionxform = str
    cp.read_string(path.read_text())
    return cp["Desktop Entry"]


def test_linux_desktop_entries():
    proj = P.load()
    icon = Path(P.APP_ICON).stem
    app = _desktop(INST / "linux" / "flotilla.desktop")
    agent = _desktop(INST / "linux" / "flotilla-agent.desktop")
    auto = _desktop(INST / "linux" / "flotilla-agent-autostart.desktop")
    assert app["Exec"].split()[0] == proj.cli_script and app["Icon"] == icon
    assert app["StartupWMClass"] == "flotilla"  # app/main.py: setDesktopFileName("flotilla")
    assert agent["Exec"].split()[0] == P.AGENT_EXE and agent["Icon"] == icon
    assert auto["Exec"].endswith("/" + P.AGENT_EXE) and auto["TryExec"] == auto["Exec"]
    assert auto["NoDisplay"] == "true" and auto["Type"] == "Application"
    validate = shutil.which("desktop-file-validate")
    if validate:
        for name in ("flotilla.desktop", "flotilla-agent.desktop", "flotilla-agent-autostart.desktop"):
            res = subprocess.run([validate, str(INST / "linux" / name)], capture_output=True, text=True)
            assert res.returncode == 0, res.stdout + res.stderr


def test_agent_ports_agree_with_the_fleet():
    from engine.fleet.discovery import DEFAULT_BASE_PORT, INFO_OFFSET, PAIR_OFFSET

    assert P.AGENT_TCP_PORTS == (DEFAULT_BASE_PORT, DEFAULT_BASE_PORT + PAIR_OFFSET, DEFAULT_BASE_PORT + INFO_OFFSET)
    fleet_doc = (REPO / "docs" / "fleet.md").read_text()
    for port in (*P.AGENT_TCP_PORTS, P.MDNS_UDP_PORT):
        assert str(port) in fleet_doc
    lo, hi = P.AGENT_TCP_PORTS[0], P.AGENT_TCP_PORTS[-1]
    assert f'#define AgentPorts "{lo}-{hi}"' in ISS
    assert f'#define MdnsPort "{P.MDNS_UDP_PORT}"' in ISS
    install_doc = (REPO / "docs" / "install.md").read_text()
    for port in (*P.AGENT_TCP_PORTS, P.MDNS_UDP_PORT):
        assert str(port) in install_doc


def test_inno_setup_script():
    proj = P.load()
    defines = dict(re.findall(r'#define (\w+) "([^"]*)"', ISS))
    assert defines["AgentExe"] == P.AGENT_EXE + ".exe"
    assert defines["CliExe"] == proj.cli_script + ".exe"
    assert defines["AppExe"] == "FlotillaApp.exe" and '"FlotillaApp"' in SPEC
    assert defines["RunValue"] == autostart.WIN_RUN_VALUE
    added = set(re.findall(r'firewall add rule name=""([^"]+)""', ISS))
    deleted = set(re.findall(r'firewall delete rule name=""([^"]+)""', ISS))
    assert added and added == deleted, "every firewall rule added must be removed on uninstall"
    assert "uninsdeletevalue" in ISS and "[UninstallDelete]" in ISS
    assert re.search(r"^AppId=\{\{[0-9A-F-]{36}\}", ISS, re.M)


def test_macos_recipes():
    plist = plistlib.loads(autostart.mac_entry(["/Applications/Flotilla.app/Contents/MacOS/flotilla-agent"]).encode())
    assert plist["Label"] == P.AGENT_ID == autostart.MAC_LABEL
    assert plist["ProgramArguments"] == ["/Applications/Flotilla.app/Contents/MacOS/flotilla-agent"]
    assert plist["RunAtLoad"] is True
    assert "bundle_identifier=project.BUNDLE_ID" in SPEC and "CFBundleShortVersionString" in SPEC
    assert P.BUNDLE_ID.startswith("org.flotilla.")


def test_ci_workflow_builds_every_os():
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load(WORKFLOW.read_text())
    jobs = wf["jobs"]
    runners = " ".join(str(j["runs-on"]) for j in jobs.values())
    assert "windows" in runners and "macos" in runners and "ubuntu" in runners
    text = WORKFLOW.read_text()
    assert "installers.build" in text and "iscc" in text.lower() and "make_dmg.sh" in text
    assert "installers.project version" in text


def test_bundle_rules():
    ex = bundle_rules.excluded
    for dest in ("torch/test/foo", "torch/bin/test_api", "torch/include/c10/x.h",
                 "openvino/libs/libopenvino_onnx_frontend.so.2641", "openvino/libs/openvino_onnx_frontend.dll",
                 "PySide6/Qt/qml/QtQuick/x", "PySide6/Qt/lib/libQt6Quick.so.6", "PySide6/Qt6Quick.dll",
                 "PySide6/Qt/plugins/platforms/libqeglfs.so", "PySide6/Qt/translations/qt_de.qm",
                 "libcudart.so", "PySide6/Qt/plugins/platformthemes/libqgtk3.so"):
        assert ex(dest), dest
    for dest in ("torch/bin/torch_shm_manager", "torch/lib/libtorch_cpu.so",
                 "openvino/libs/libopenvino_intel_cpu_plugin.so", "openvino/libs/libopenvino_intel_gpu_plugin.so",
                 "openvino/libs/libopenvino_pytorch_frontend.so.2641", "openvino/libs/plugins.xml",
                 "PySide6/Qt/plugins/platforms/libqxcb.so", "PySide6/Qt/plugins/platforms/libqoffscreen.so",
                 "PySide6/Qt/plugins/imageformats/libqsvg.so", "PySide6/Qt/translations/qtbase_de.qm",
                 "assets/demo/corpus.txt", "libstdc++.so.6"):
        assert not ex(dest), dest
    assert ex("libstdc++.so.6", linux=True) and ex("libxcb-cursor.so.0", linux=True)
    assert not ex("PySide6/Qt/lib/libQt6XcbQpa.so.6", linux=True)
    toc = [("libopenvino_onnx_frontend.so.2641", "openvino/libs/libopenvino_onnx_frontend.so.2641", "SYMLINK"),
           ("libQt6Core.so.6", "PySide6/Qt/lib/libQt6Core.so.6", "SYMLINK")]
    assert [e[0] for e in bundle_rules.filter_toc(toc)] == ["libQt6Core.so.6"]
    for pat in bundle_rules.REQUIRED_FILES_LINUX:
        assert not ex(pat.replace("*", "x")), f"a required file is excluded: {pat}"
    assert "torchvision" in bundle_rules.EXCLUDED_MODULES


def test_launcher_picks_entry_by_executable_name():
    entries = {"flotilla": ("engine.cli.main:main", ()), "flotilla-agent": ("engine.cli.main:main", ("agent",)),
               "FlotillaApp": ("engine.cli.main:main", ())}
    assert launcher.entry_for("/opt/flotilla/flotilla-agent", entries)[1] == ("agent",)
    assert launcher.entry_for(r"C:\Program Files\Flotilla\FLOTILLA-AGENT.EXE", entries)[1] == ("agent",)
    assert launcher.entry_for("/x/FlotillaApp", entries)[1] == ()
    assert launcher.entry_for("/x/something-else", entries) == entries["flotilla"]


def test_launcher_emulates_python_m_and_c():
    pm = launcher.python_mode
    assert pm(["-m", "engine.pipeline.worker", "--shard", "x"]) == ("-m", "engine.pipeline.worker", ["--shard", "x"])
    assert pm(["-u", "-X", "utf8", "-c", "print(1)", "a"]) == ("-c", "print(1)", ["a"])
    assert pm([]) is None and pm(["chat", "-m", "demo"]) is None and pm(["--version"]) is None
    assert pm(["agent", "--port", "1"]) is None


def test_autostart_linux(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert not autostart.is_enabled("linux")
    where = autostart.enable(["/opt/flotilla/flotilla-agent"], platform="linux")
    assert where == str(tmp_path / "autostart" / "flotilla-agent.desktop")
    assert autostart.is_enabled("linux")
    entry = _desktop(Path(where))
    assert entry["Exec"] == entry["TryExec"] == "/opt/flotilla/flotilla-agent"
    autostart.enable([sys.executable, "-m", "engine.cli.agent_cmd"], platform="linux")  # overwrite
    assert _desktop(Path(where))["Exec"].endswith("-m engine.cli.agent_cmd")
    assert autostart.disable("linux") is True
    assert not autostart.is_enabled("linux") and autostart.disable("linux") is False


def test_autostart_macos_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    where = autostart.enable(["/Applications/Flotilla.app/Contents/MacOS/flotilla-agent"], platform="darwin")
    assert where == str(tmp_path / "Library" / "LaunchAgents" / "org.flotilla.agent.plist")
    assert plistlib.loads(Path(where).read_bytes())["Label"] == "org.flotilla.agent"
    assert autostart.is_enabled("darwin") and autostart.disable("darwin") and not autostart.is_enabled("darwin")


def test_autostart_windows_value():
    assert autostart.windows_entry([r"C:\Program Files\Flotilla\flotilla-agent.exe"]) == \
        r'"C:\Program Files\Flotilla\flotilla-agent.exe"'
    assert autostart.entry_path("win32").endswith(r"CurrentVersion\Run\FlotillaAgent")


def test_autostart_command_from_a_checkout():
    assert autostart.agent_command("linux")[1:] == ["-m", "engine.cli.agent_cmd"]


def test_clean_copy_and_cache_key(tmp_path):
    from installers import build

    files = build.source_files()
    assert "pyproject.toml" in files and "installers/flotilla.spec" in files
    assert "assets/demo/corpus.txt" in files and "engine/cli/main.py" in files
    assert not [f for f in files if f.startswith(("tests/", "docs/", ".cache/", "build/")) or "__pycache__" in f]
    key = build.cache_key(REPO, files)
    assert key == build.cache_key(REPO, files) and len(key) == 20
    build.clean_copy(REPO, files[:3], tmp_path / "src")
    assert sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*") if p.is_file()) \
        == sorted(files[:3])


def test_makefile_has_dist_target():
    mk = (REPO / "Makefile").read_text()
    assert re.search(r"^dist: setup$", mk, re.M) and "-m installers.build" in mk
    assert re.search(r"^\.PHONY:.*\bdist\b", mk, re.M)
