"""The installer recipes agree with pyproject.toml and with each other.

Windows and macOS installers cannot be built on Linux CI; these checks keep
their recipes honest between CI runs on hosted runners: one version, one set
of entry points, icons that exist, the agent's ports as docs/fleet.md says,
every firewall rule added is removed on uninstall. Fast (no build).
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
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

from installers import autostart, bundle_rules, launcher, macapp  # noqa: E402
from installers import project as P  # noqa: E402

INST = REPO / "installers"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
ISS = (INST / "windows" / "flotilla.iss").read_text(encoding="utf-8")
SPEC = (INST / "flotilla.spec").read_text(encoding="utf-8")
WORKFLOW = REPO / ".github" / "workflows" / "installers.yml"
PORTABLE = REPO / ".github" / "workflows" / "portable.yml"


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
               INST / "macos" / "org.flotilla.agent.plist", INST / "linux" / "deb.py", INST / "macapp.py",
               WORKFLOW, PORTABLE]
    for path in recipes:
        text = path.read_text(encoding="utf-8")
        assert not re.search(rf"(?<![\d.]){version}(?![\d.])", text), f"{path.name} hard-codes the version"
        for target in targets:
            assert target not in text, f"{path.name} hard-codes the entry point {target}"
    assert "project.load(" in SPEC and "PROJ.scripts" in SPEC and "PROJ.gui_entry_points" in SPEC
    assert "#error" in ISS and "AppVersion={#AppVersion}" in ISS
    assert "installers.project version" in (INST / "macos" / "make_dmg.sh").read_text(encoding="utf-8")


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
    cp.read_string(path.read_text(encoding="utf-8"))
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
    fleet_doc = (REPO / "docs" / "fleet.md").read_text(encoding="utf-8")
    for port in (*P.AGENT_TCP_PORTS, P.MDNS_UDP_PORT):
        assert str(port) in fleet_doc
    lo, hi = P.AGENT_TCP_PORTS[0], P.AGENT_TCP_PORTS[-1]
    assert f'#define AgentPorts "{lo}-{hi}"' in ISS
    assert f'#define MdnsPort "{P.MDNS_UDP_PORT}"' in ISS
    install_doc = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
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
    agent = "/Applications/Flotilla.app/Contents/Helpers/Flotilla Agent.app/Contents/MacOS/flotilla-agent"
    plist = plistlib.loads(autostart.mac_entry([agent]).encode())
    assert plist["Label"] == P.AGENT_ID == autostart.MAC_LABEL
    assert plist["ProgramArguments"] == [agent]
    assert plist["RunAtLoad"] is True
    # Lent compute runs at full speed: Background would confine the agent and its shard
    # workers to the efficiency cores with throttled I/O.
    assert plist.get("ProcessType") not in ("Background", "Adaptive") and plist["ProcessType"] == "Interactive"
    assert plist["AssociatedBundleIdentifiers"] == [P.BUNDLE_ID]
    template = plistlib.loads((INST / "macos" / "org.flotilla.agent.plist").read_bytes())
    assert template["ProgramArguments"] == [macapp.agent_executable(Path("/Applications/Flotilla.app")).as_posix()]
    assert "bundle_identifier=project.BUNDLE_ID" in SPEC and "macapp.app_info_plist(PROJ)" in SPEC
    assert P.BUNDLE_ID.startswith("org.flotilla.")
    app_plist = macapp.app_info_plist(P.load())
    assert app_plist["CFBundleShortVersionString"] == PYPROJECT["version"] and "LSUIElement" not in app_plist


def test_macos_agent_is_its_own_menu_bar_helper_bundle():
    proj = P.load()
    info = macapp.agent_info_plist(proj)
    assert info["CFBundleIdentifier"] == P.AGENT_BUNDLE_ID != P.BUNDLE_ID  # its own id, not the app's
    assert info["CFBundleIdentifier"].startswith(P.BUNDLE_ID + ".")
    assert info["LSUIElement"] is True  # no Dock icon, no app menu
    assert info["CFBundleExecutable"] == P.AGENT_EXE and info["CFBundlePackageType"] == "APPL"
    assert info["CFBundleShortVersionString"] == proj.version and info["CFBundleVersion"] == proj.numeric_version
    assert info["NSBonjourServices"] == ["_flotilla._tcp"] and info["NSLocalNetworkUsageDescription"]
    plistlib.loads(plistlib.dumps(info))  # a valid plist
    assert macapp.AGENT_APP == autostart.MAC_AGENT_APP


def _fake_pyinstaller_app(root: Path) -> Path:
    """The layout PyInstaller's BUNDLE makes (installers/flotilla.spec), with stand-in files."""
    app = root / "Flotilla.app"
    c = app / "Contents"
    (c / "MacOS").mkdir(parents=True)
    for exe in ("FlotillaApp", "flotilla", P.AGENT_EXE):
        (c / "MacOS" / exe).write_bytes(b"\xcf\xfa\xed\xfe" + exe.encode())
    (c / "Frameworks" / "engine").mkdir(parents=True)
    (c / "Frameworks" / "Python").write_bytes(b"libpython")
    (c / "Resources" / "assets").mkdir(parents=True)
    (c / "Resources" / "assets" / "corpus.txt").write_text("demo", encoding="utf-8")
    (c / "Resources" / "flotilla.icns").write_bytes(b"icns")
    # PyInstaller's cross-link of a data folder from Frameworks into Resources (relative):
    os.symlink(os.path.join("..", "Resources", "assets"), c / "Frameworks" / "assets", target_is_directory=True)
    (c / "Info.plist").write_bytes(plistlib.dumps({"CFBundleIdentifier": P.BUNDLE_ID}))
    return app


def test_macos_helper_bundle_layout(tmp_path):
    """make_helper: the agent in its own bundle, one copy of the payload, every path the
    executables use still resolving (here: plain files; on the macOS runner: the real .app)."""
    app = _fake_pyinstaller_app(tmp_path / "dist")
    helper = macapp.make_helper(app, P.load())
    assert macapp.check_layout(app) == []
    assert helper == app / "Contents" / "Helpers" / "Flotilla Agent.app"
    c = app / "Contents"
    assert sorted(p.name for p in (c / "MacOS").iterdir()) == ["FlotillaApp", "flotilla"]
    assert macapp.agent_executable(app).read_bytes().endswith(P.AGENT_EXE.encode())
    # The outer executables' <exe>/../Frameworks and ../Resources reach the one payload:
    assert (c / "MacOS" / ".." / "Frameworks" / "Python").read_bytes() == b"libpython"
    assert (c / "Frameworks" / "assets" / "corpus.txt").read_text(encoding="utf-8") == "demo"
    hc = helper / "Contents"
    assert (hc / "MacOS" / ".." / "Frameworks" / "Python").read_bytes() == b"libpython"
    assert not (hc / "Frameworks").is_symlink() and (hc / "Frameworks" / "assets").is_symlink()
    for link in (c / "Frameworks", c / "Resources"):  # relative and inside the outer bundle
        target = os.readlink(link)
        assert not os.path.isabs(target) and target.startswith("Helpers")
    assert plistlib.loads((hc / "Info.plist").read_bytes())["LSUIElement"] is True
    assert (hc / "Resources" / macapp.ICON).exists()  # the helper's CFBundleIconFile
    # Moving the installed app keeps it working (no absolute link anywhere):
    moved = tmp_path / "Applications" / "Flotilla.app"
    moved.parent.mkdir()
    shutil.move(str(app), str(moved))
    assert macapp.check_layout(moved) == [] and (moved / "Contents" / "Frameworks" / "Python").exists()
    assert macapp.make_helper(moved, P.load()) == macapp.helper_path(moved)  # idempotent


def test_macos_autostart_starts_the_helpers_agent(monkeypatch, tmp_path):
    app = tmp_path / "Flotilla.app"
    expected = app / "Contents" / "Helpers" / "Flotilla Agent.app" / "Contents" / "MacOS" / "flotilla-agent"
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    for running in (app / "Contents" / "MacOS" / "FlotillaApp", expected):  # from the app, from the agent
        monkeypatch.setattr(sys, "executable", str(running))
        assert autostart.agent_command("darwin") == [str(expected.resolve())]
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bundle" / "flotilla.exe"))
    assert autostart.agent_command("win32") == [str((tmp_path / "bundle" / "flotilla-agent.exe").resolve())]


def _workflow(path: Path) -> tuple[dict, str]:
    yaml = pytest.importorskip("yaml")
    text = path.read_text(encoding="utf-8")
    wf = yaml.safe_load(text)
    wf["on"] = wf.pop(True, wf.get("on"))  # YAML 1.1 reads the key `on` as True
    return wf, text


def _trigger_paths(wf: dict) -> list[str]:
    return wf["on"]["pull_request"]["paths"]


def test_ci_workflow_builds_every_os():
    wf, text = _workflow(WORKFLOW)
    jobs = wf["jobs"]
    runners = " ".join(str(j["runs-on"]) for j in jobs.values())
    assert "windows" in runners and "macos" in runners and "ubuntu" in runners
    assert "installers.build" in text and "iscc" in text.lower() and "make_dmg.sh" in text
    assert "installers.project version" in text
    for where in ("engine/**", "app/**", "installers/**", ".github/workflows/installers.yml"):
        assert where in _trigger_paths(wf) and where in wf["on"]["push"]["paths"], where
    # The bundles are smoke-tested with the fleet, not only --version:
    assert text.count("selftest") >= 2 and "Flotilla Agent.app" in text


def test_ci_runs_the_suite_and_the_selftest_on_every_os():
    """The hosted runners install, run the unit suite (the parts that need no cgroups, network
    namespaces or root, selected by path) and `flotilla selftest`, on every change to the code."""
    wf, text = _workflow(PORTABLE)
    for where in ("engine/**", "app/**", "installers/**", ".github/workflows/portable.yml"):
        assert where in _trigger_paths(wf) and where in wf["on"]["push"]["paths"], where
    (job,) = wf["jobs"].values()
    oses = job["strategy"]["matrix"]["os"]
    assert {"windows-latest", "macos-latest", "ubuntu-latest"} <= set(oses) and job["runs-on"] == "${{ matrix.os }}"
    assert job["strategy"].get("fail-fast") is False  # one OS failing must not hide the others
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "flotilla selftest" in runs and "pip install" in runs and "build-demos" in runs
    suite = next(step["run"] for step in job["steps"] if "pytest" in step.get("run", ""))
    selected = suite.split()
    for path in ("tests/engine", "tests/app", "tests/installers/test_installers_recipes.py",
                 "tests/test_import_windows.py"):
        assert path in selected, path
        assert (REPO / path).exists(), path
    for heavy in ("tests/engine/bench", "tests/e2e"):  # cgroups, network namespaces, root
        assert heavy not in selected and f"--ignore={heavy}" in selected, heavy
    assert "-k" not in selected and "skip" not in suite  # selected by path, never skipped


def test_uninstaller_removes_exactly_the_folder_the_user_chose():
    """%LOCALAPPDATA%\\flotilla holds one folder per kind (engine/paths.py); the uninstaller asks
    once per folder and removes only that one, never the whole root (which held the chat
    history next to the settings before)."""
    import platformdirs.windows

    from engine import paths

    defines = dict(re.findall(r'#define (\w+) "([^"]*)"', ISS))
    f = paths.default_folders("windows", {"LOCALAPPDATA": "{localappdata}", "USERPROFILE": "C:/Users/u"})
    root = defines["UserRoot"].replace("\\", "/")
    assert root == f.settings.parent.as_posix()
    subs = {k: defines[k] for k in ("HistoryDir", "KeysDir", "SettingsDir", "DataDir", "CacheDir")}
    assert {subs["HistoryDir"], subs["KeysDir"], subs["SettingsDir"], subs["DataDir"]} == set(paths.KINDS)
    for kind in paths.KINDS:
        assert f.of(kind).parent.as_posix() == root
    # The model cache: platformdirs' Windows user cache folder, which is inside the same root.
    import unittest.mock as mock

    with mock.patch.object(platformdirs.windows, "get_win_folder", lambda _csidl: "{localappdata}"):
        cache = Path(platformdirs.windows.Windows("flotilla", appauthor=False).user_cache_dir)
    assert cache.as_posix() == f"{root}/{subs['CacheDir']}"
    code = ISS[ISS.index("[Code]"):]
    asked = re.findall(r"RemoveIfWanted\('[^;]*?', '\{#(\w+)\}'\);", code, re.S)
    assert sorted(asked) == sorted(subs), asked  # each folder asked about once
    assert code.count("DelTree(") == 1 and "DelTree(Folder," in code  # only the folder asked about
    assert "RemoveDir(ExpandConstant('{#UserRoot}'))" in code  # the root: only when empty
    assert "engine.paths migrate" in ISS  # earlier versions' flat files are sorted into them first
    history_q = re.search(r"RemoveIfWanted\('([^']*)', '\{#HistoryDir\}'", code).group(1)
    settings_q = re.search(r"RemoveIfWanted\('([^']*)', '\{#SettingsDir\}'", code).group(1)
    assert "history" in history_q and "history" not in settings_q


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
    assert pm(["-m", "engine.shards.worker", "--shard", "x"]) == ("-m", "engine.shards.worker", ["--shard", "x"])
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
    # Path.home() reads HOME on POSIX and USERPROFILE on Windows: fake both, so this runs anywhere.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("USERPROFILE", str(tmp_path))
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
    # as_posix: on Windows str() of a relative path has backslashes, git's file list has slashes.
    assert sorted(p.relative_to(tmp_path / "src").as_posix() for p in (tmp_path / "src").rglob("*") if p.is_file()) \
        == sorted(files[:3])


def test_cache_key_is_the_same_whatever_the_caller_has_on_sys_path(tmp_path, monkeypatch):
    """The suite's background build and the installers test compute the key in different
    processes; a folder holding a distribution on one's sys.path must not make it build twice."""
    from installers import build

    before = build.environment_fingerprint()
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "stray-9.9.dist-info").mkdir()
    (other / "stray-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: stray\nVersion: 9.9\n")
    monkeypatch.syspath_prepend(str(other))
    assert any(d.metadata["Name"] == "stray" for d in importlib.metadata.distributions())  # visible to the process
    assert build.environment_fingerprint() == before
    assert "pyinstaller==" + importlib.metadata.version("pyinstaller") in before["dists"]


def test_makefile_has_dist_target():
    mk = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^dist: setup$", mk, re.M) and "-m installers.build" in mk
    assert re.search(r"^\.PHONY:.*\bdist\b", mk, re.M)


def test_install_doc_matrix_names_tests_that_exist():
    """docs/install.md's feature x OS matrix: every test it names is there (a renamed or removed
    test must not leave the matrix claiming coverage), and every feature has a row."""
    doc = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    matrix = doc[doc.index("## Windows, macOS and Linux: which code runs"):]
    matrix = matrix[:matrix.index("\n## ")]
    rows = [line for line in matrix.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    features = [r.split("|")[1].strip() for r in rows]
    for want in ("fleet sockets, event loop", "worker spawn / stop", "parent-death watch", "MoE / sparse reads",
                 "idle detection", "machine identity", "addresses", "folders", "UTF-8 output", "tray / autostart"):
        assert want in features, want
    named = 0
    for row in rows:
        tested = row.split("|")[5]
        current = None
        for token in re.findall(r"`([^`]+)`", tested):
            path, _, name = token.partition("::")
            if path.startswith("tests/"):
                current = REPO / path
                assert current.exists(), path
            if name:
                assert current is not None, token
                assert re.search(rf"^(async )?def {re.escape(name)}\(", current.read_text(encoding="utf-8"), re.M), \
                    f"{current.relative_to(REPO)} has no test {name}"
                named += 1
    assert named >= 30
