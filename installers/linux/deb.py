"""The Linux package: a .deb built with dpkg-deb around the PyInstaller bundle.

Why a .deb and not an AppImage: Flotilla targets Debian/Ubuntu desktops (as
the README does), where a .deb is what a user double-clicks (GNOME Software,
KDE Discover, `apt install ./flotilla_*.deb`) and what an office IT deploys
with its usual tools; it installs the menu entry, icons and the agent's
autostart template where the desktop looks for them, declares the system
libraries it needs (computed with dpkg-shlibdeps, so apt installs them), and
`apt remove flotilla` removes every file it installed. An AppImage would have
to integrate itself into the menu at first run and cannot be uninstalled
cleanly, mounts ~1 GB of squashfs at every start, and its build tool
(appimagetool) is not on PyPI nor in Debian; dpkg-deb is on every Debian.

Layout:
  /opt/flotilla/                     the one-folder bundle (flotilla, flotilla-agent, _internal/)
  /usr/bin/flotilla, flotilla-agent  symlinks into /opt/flotilla
  /usr/share/applications/flotilla.desktop, flotilla-agent.desktop
  /usr/share/icons/hicolor/{N}x{N}/apps/flotilla.png, scalable/apps/flotilla.svg
  /usr/share/flotilla/autostart/flotilla-agent.desktop   (for IT: copy to /etc/xdg/autostart)
  /usr/share/doc/flotilla/copyright
No maintainer scripts: dpkg's triggers refresh the icon cache and the menu.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from installers import project as P
from installers.autostart import linux_entry

LINUX = P.INSTALLERS / "linux"
PREFIX = "opt/flotilla"  # where the bundle goes, relative to /
MAINTAINER = "Flotilla developers <flotilla@localhost>"
HOMEPAGE = ""
# Not libraries, so dpkg-shlibdeps cannot find them: fonts for Qt to draw text.
RECOMMENDS = ["fonts-dejavu-core"]
# NEEDED libraries that may legitimately be missing (loaded only on hardware that has them).
OPTIONAL_LIBS = re.compile(r"^lib(cuda|nvidia|OpenCL|ze_loader|level_zero|hiprtc|amdhip|va|va-drm|mfx|vpl)")


def deb_arch() -> str:
    out = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True)
    return out.stdout.strip() or "amd64"


def _is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def elf_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink() and _is_elf(p)]


def needed_libs(files: list[Path]) -> dict[Path, list[str]]:
    """{file: NEEDED sonames} from readelf, in batches."""
    out: dict[Path, list[str]] = {}
    for i in range(0, len(files), 200):
        batch = files[i:i + 200]
        text = subprocess.run(["readelf", "-d", "-W", *map(str, batch)], capture_output=True,
                              text=True).stdout
        current = None
        for line in text.splitlines():
            if line.startswith("File: "):
                current = Path(line[6:].strip())
                out.setdefault(current, [])
            elif "(NEEDED)" in line and current is not None:
                m = re.search(r"\[(.+?)\]", line)
                if m:
                    out[current].append(m.group(1))
        if len(batch) == 1 and batch[0] not in out:
            out[batch[0]] = []
    return out


# Libraries that only some desktops have (Wayland sessions, GPU drivers); when
# the build machine lacks them dpkg-shlibdeps cannot map them, so they are
# declared here. soname prefix -> (field, package).
KNOWN_SONAMES = {
    "libwayland-client.so": ("Depends", "libwayland-client0"),
    "libwayland-cursor.so": ("Depends", "libwayland-cursor0"),
    "libwayland-egl.so": ("Depends", "libwayland-egl1"),
    "libOpenCL.so": ("Recommends", "ocl-icd-libopencl1"),  # OpenVINO's GPU plugin (Intel GPUs)
}


def version_needs(files: list[Path]) -> dict[Path, dict[str, tuple[int, ...]]]:
    """{file: {soname: highest symbol version it needs}} from readelf -V
    (e.g. libc.so.6: (2, 34) for GLIBC_2.34)."""
    out: dict[Path, dict[str, tuple[int, ...]]] = {}
    for i in range(0, len(files), 200):
        batch = files[i:i + 200]
        text = subprocess.run(["readelf", "-V", "-W", *map(str, batch)], capture_output=True, text=True).stdout
        current, lib = None, None
        for line in text.splitlines():
            if line.startswith("File: ") and "Version" not in line:
                current, lib = Path(line[6:].strip()), None
                out.setdefault(current, {})
            elif "File: " in line and "Cnt:" in line:
                lib = line.split("File: ")[1].split()[0]
            elif "Name: " in line and current is not None and lib:
                m = re.search(r"Name: [A-Z_]+?_?(\d+(?:\.\d+)*)", line)
                if m:
                    v = tuple(int(x) for x in m.group(1).split("."))
                    out[current][lib] = max(out[current].get(lib, ()), v)
    return out


def system_dependencies(bundle: Path) -> tuple[str, list[str], list[str]]:
    """(Depends, Recommends, libraries found nowhere) of the bundle.

    dpkg-shlibdeps maps libraries to Debian packages with minimum versions;
    it takes minutes for the ~300 ELF files of the bundle, so it gets one
    representative per outside library: the file that needs the highest
    symbol version of it (so versions are as strict as for all files)."""
    files = elf_files(bundle)
    inside = {p.name for p in bundle.rglob("*.so*")}
    needs = needed_libs(files)
    vneeds = version_needs(files)
    ld_cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    on_system = set(re.findall(r"^\s+(\S+) \(", ld_cache, flags=re.M))
    best: dict[str, tuple[tuple[int, ...], Path]] = {}  # soname -> (version, file)
    depends, recommends, missing = set(), set(), set()
    unclean: set[Path] = set()  # files needing a library this machine lacks
    for path, libs in needs.items():
        for lib in libs:
            if lib in inside or lib in on_system:
                continue
            unclean.add(path)
            known = next((v for k, v in KNOWN_SONAMES.items() if lib.startswith(k)), None)
            if known:
                (depends if known[0] == "Depends" else recommends).add(known[1])
            elif not OPTIONAL_LIBS.match(lib):
                missing.add(lib)
    wanted = {lib for libs in needs.values() for lib in libs if lib not in inside and lib in on_system}
    for path, libs in needs.items():
        if path in unclean:  # dpkg-shlibdeps would stop at the missing library
            continue
        for lib in libs:
            if lib in wanted:
                v = vneeds.get(path, {}).get(lib, ())
                if lib not in best or v > best[lib][0]:
                    best[lib] = (v, path)
    # Needed only by unclean files: the package that holds it, without a version.
    paths = dict(re.findall(r"^\s+(\S+) \(libc6,x86-64[^)]*\) => (\S+)", ld_cache, flags=re.M))
    for lib in sorted(wanted - set(best)):
        res = subprocess.run(["dpkg", "-S", os.path.realpath(paths.get(lib, lib))], capture_output=True, text=True)
        if res.returncode == 0:
            depends.add(res.stdout.split(":")[0].strip())
    reps = sorted({str(p) for _, p in best.values()})
    lib_dirs = sorted({str(p.parent) for p in bundle.rglob("*.so*")})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "debian").mkdir()
        (Path(tmp) / "debian" / "control").write_text("Source: flotilla\n\nPackage: flotilla\nArchitecture: any\n")
        # Only the representatives' outside libraries matter; their bundled
        # neighbours are found through -l (and have no package: ignored).
        cmd = ["dpkg-shlibdeps", "-O", "--ignore-missing-info", "--warnings=0",
               *[f"-l{d}" for d in lib_dirs], *[f"-e{p}" for p in reps]]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    if res.returncode != 0:
        errors = [line for line in res.stderr.splitlines() if "error" in line]
        raise RuntimeError("dpkg-shlibdeps failed: " + "\n".join(errors[:10] or [res.stderr[-2000:]]))
    shlibs = [d.strip() for d in res.stdout.strip().partition("shlibs:Depends=")[2].split(",") if d.strip()]
    return ", ".join(shlibs + sorted(depends)), sorted(recommends), sorted(missing)


def _copyright(proj: P.Project) -> str:
    return ("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
            f"Upstream-Name: {proj.name}\n\nFiles: *\nCopyright: Flotilla developers\n"
            f"License: {proj.license}\n Bundled third-party components (Python, PyTorch, OpenVINO,\n"
            " Qt/PySide6 under LGPLv3, transformers, ...) keep their own licenses; see the\n"
            " *.dist-info folders inside /opt/flotilla/_internal.\n")


def stage(bundle: Path, root: Path, proj: P.Project, icons: dict[str, Path]) -> None:
    """Lay the package's files out under root (the future /)."""
    opt = root / PREFIX
    opt.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(bundle, opt, symlinks=True)
    usr_bin = root / "usr" / "bin"
    usr_bin.mkdir(parents=True)
    for exe in (proj.cli_script, P.AGENT_EXE):
        if not (opt / exe).exists():
            raise RuntimeError(f"the bundle has no {exe}")
        os.symlink(f"/{PREFIX}/{exe}", usr_bin / exe)
    share = root / "usr" / "share"
    apps = share / "applications"
    apps.mkdir(parents=True)
    for name in ("flotilla.desktop", "flotilla-agent.desktop"):
        shutil.copy2(LINUX / name, apps / name)
    auto = share / "flotilla" / "autostart"
    auto.mkdir(parents=True)
    (auto / "flotilla-agent.desktop").write_text(linux_entry([f"/usr/bin/{P.AGENT_EXE}"]), encoding="utf-8")
    hicolor = share / "icons" / "hicolor"
    (hicolor / "scalable" / "apps").mkdir(parents=True)
    shutil.copy2(P.ICONS / P.APP_ICON, hicolor / "scalable" / "apps" / "flotilla.svg")
    for key, png in icons.items():
        if key.startswith("png"):
            size = key[3:]
            d = hicolor / f"{size}x{size}" / "apps"
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy2(png, d / "flotilla.png")
    doc = share / "doc" / proj.name
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(_copyright(proj), encoding="utf-8")


def control(proj: P.Project, root: Path, depends: str, recommends: list[str]) -> str:
    size_kb = sum(p.lstat().st_size for p in root.rglob("*") if not p.is_dir()) // 1024
    lines = [
        f"Package: {proj.name}",
        f"Version: {proj.version}",
        f"Architecture: {deb_arch()}",
        f"Maintainer: {MAINTAINER}",
        f"Installed-Size: {size_kb}",
        f"Depends: {depends}",
        f"Recommends: {', '.join(RECOMMENDS + recommends)}",
        "Section: net",
        "Priority: optional",
        f"Description: {proj.description}",
        " A desktop app and a tray agent: the app finds idle PCs on the LAN (mDNS),",
        " runs LLMs across them with OpenVINO and hosts a chat window and an",
        " OpenAI-compatible API; the agent lends this PC to the fleet while it is idle.",
        " Self-contained: Python, PyTorch (CPU), OpenVINO and Qt are bundled in",
        " /opt/flotilla.",
    ]
    return "\n".join(lines) + "\n"


def _md5sums(root: Path) -> str:
    rows = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and "DEBIAN" not in p.relative_to(root).parts:
            h = hashlib.md5()
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            rows.append(f"{h.hexdigest()}  {p.relative_to(root).as_posix()}")
    return "\n".join(rows) + "\n"


def build_deb(bundle: Path, out_dir: Path, icons: dict[str, Path], proj: P.Project | None = None,
              compression: str = "zstd", workdir: Path | None = None) -> dict:
    """Build flotilla_<version>_<arch>.deb from a PyInstaller bundle folder.
    compression: zstd (default; dpkg >= 1.21.18: Debian 12, Ubuntu 21.10+), xz
    (any dpkg; smaller, several minutes slower), gzip or none."""
    proj = proj or P.load()
    depends, recommends, missing = system_dependencies(bundle)
    if missing:
        raise RuntimeError(f"libraries needed by the bundle but found nowhere: {', '.join(missing)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp) / "root"
        stage(bundle, root, proj, icons)
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN" / "control").write_text(control(proj, root, depends, recommends), encoding="utf-8")
        (root / "DEBIAN" / "md5sums").write_text(_md5sums(root), encoding="utf-8")
        for p in root.rglob("*"):  # dpkg wants sane modes: 0755 dirs and executables, 0644 files
            if p.is_symlink():
                continue
            if p.is_dir() or os.access(p, os.X_OK):
                p.chmod(0o755)
            else:
                p.chmod(0o644)
        deb = out_dir / f"{proj.name}_{proj.version}_{deb_arch()}.deb"
        level = {"zstd": ["-z9"], "xz": ["-z6"], "gzip": ["-z6"], "none": []}[compression]
        subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", *level, "--build",
                        str(root), str(deb)], check=True, capture_output=True)
    return {"deb": deb, "deb_bytes": deb.stat().st_size, "depends": depends}
