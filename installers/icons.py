"""Icons for the installers, rendered from assets/icons/flotilla.svg.

PNGs at the hicolor sizes (Linux), a multi-size .ico (Windows: the .exe files
and Setup.exe) and an .icns (macOS .app). Rendering uses Qt's SVG renderer
(PySide6 is a Flotilla dependency); .ico and .icns are written by hand (both
are a small header around PNG images), so no imaging library is needed.

    python -m installers.icons OUT_DIR      # flotilla.ico, flotilla.icns, png/<size>.png
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

from installers.project import APP_ICON, ICONS

PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)  # hicolor/<N>x<N>/apps
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
# .icns chunk type -> pixel size (PNG payloads; macOS 10.7+).
ICNS_TYPES = (("icp4", 16), ("icp5", 32), ("ic07", 128), ("ic08", 256), ("ic09", 512),
              ("ic10", 1024), ("ic11", 32), ("ic12", 64), ("ic13", 256), ("ic14", 512))


def render_pngs(svg: Path, sizes) -> dict[int, bytes]:
    """{size: PNG bytes} of the SVG rendered square, transparent background."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841 (keeps Qt alive)
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"icons: cannot render {svg}")
    out = {}
    for size in sorted(set(sizes)):
        img = QImage(size, size, QImage.Format.Format_ARGB32)
        img.fill(Qt.GlobalColor.transparent)
        painter = QPainter(img)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        data = QByteArray()
        buf = QBuffer(data)
        buf.open(QIODevice.OpenModeFlag.WriteOnly)
        img.save(buf, "PNG")
        buf.close()
        out[size] = bytes(data.data())
    return out


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """A Windows .ico holding PNG images (Vista+)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))
    offset = 6 + 16 * len(sizes)
    entries, blobs = b"", b""
    for s in sizes:
        data = pngs[s]
        dim = 0 if s >= 256 else s  # 0 means 256
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        blobs += data
        offset += len(data)
    return header + entries + blobs


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """A macOS .icns holding PNG images."""
    chunks = b""
    for kind, size in ICNS_TYPES:
        if size in pngs:
            chunks += kind.encode("ascii") + struct.pack(">I", 8 + len(pngs[size])) + pngs[size]
    return b"icns" + struct.pack(">I", 8 + len(chunks)) + chunks


def make_all(out: Path, svg: Path | None = None) -> dict[str, Path]:
    """Write flotilla.ico, flotilla.icns and png/<size>.png into out."""
    svg = svg or ICONS / APP_ICON
    sizes = set(PNG_SIZES) | set(ICO_SIZES) | {s for _, s in ICNS_TYPES}
    pngs = render_pngs(svg, sizes)
    (out / "png").mkdir(parents=True, exist_ok=True)
    result = {}
    for s in PNG_SIZES:
        p = out / "png" / f"{s}.png"
        p.write_bytes(pngs[s])
        result[f"png{s}"] = p
    result["ico"] = out / "flotilla.ico"
    result["ico"].write_bytes(ico_bytes({s: pngs[s] for s in ICO_SIZES}))
    result["icns"] = out / "flotilla.icns"
    result["icns"].write_bytes(icns_bytes(pngs))
    return result


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "build/icons")
    for name, path in make_all(dest).items():
        print(f"{name}: {path}")
