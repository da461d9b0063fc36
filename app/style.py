"""Colours, the window stylesheet and the icons, in one place so every view
looks like one app.

Two palettes (light, dark) with one accent, a sea blue. Contrast: body text on
its background is at least 7:1, muted text at least 4.5:1. `apply(theme)`
switches the module's colour names in place, so views that read style.TEXT
while painting pick up the new theme on their next repaint; views that build
HTML re-render on the `theme_changed` hook of the main window.

Sizes are in points (never pixels) in the stylesheet, so QT_SCALE_FACTOR=2
and high-DPI screens scale text and padding together.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QByteArray, QSize
from PySide6.QtGui import QColor, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtWidgets import QScrollArea, QVBoxLayout, QWidget
from PySide6.QtSvg import QSvgRenderer

ICON_DIR = Path(__file__).resolve().parent.parent / "assets" / "icons"
ICON_PATH = ICON_DIR / "flotilla.svg"
_CHEVRON = (ICON_DIR / "chevron-down.svg").as_posix()  # QSS wants forward slashes
_CHEVRON_UP = (ICON_DIR / "chevron-up.svg").as_posix()

LIGHT = dict(
    PAGE="#f5f7fa", SURFACE="#ffffff", SIDEBAR="#eef1f5", BORDER="#d5dbe3", TEXT="#1c2430",
    MUTED="#5b6678", ACCENT="#1f6feb", ACCENT_HOVER="#1a5fd0", ACCENT_PRESSED="#174fae",
    USER_BUBBLE="#1f6feb", USER_TEXT="#ffffff", ASSISTANT_BUBBLE="#e6ebf2", CODE_BG="#f0f3f7",
    ERROR="#b42318", ERROR_BG="#fdecea", OK="#1f7a45", WARN="#9a6200", DISABLED="#8a94a3",
    HOVER="#e3e8ef", SELECTED="#dbe7fb", BUTTON="#1f6feb",
)
DARK = dict(
    PAGE="#16191e", SURFACE="#1f242b", SIDEBAR="#1a1e24", BORDER="#353c46", TEXT="#e7ebf0",
    MUTED="#a3adbb", ACCENT="#4c8dff", ACCENT_HOVER="#3d7ef0", ACCENT_PRESSED="#2f6ad6",
    USER_BUBBLE="#2f6ad6", USER_TEXT="#ffffff", ASSISTANT_BUBBLE="#2a3038", CODE_BG="#12151a",
    ERROR="#ff8a80", ERROR_BG="#3a1d1b", OK="#5fd38d", WARN="#f0b45a", DISABLED="#7a8494",
    HOVER="#2a3038", SELECTED="#24385a", BUTTON="#2a62c9",  # white on it: 5.6:1
)
# Stage colours in the plan editor and the ring: distinct in both themes and
# for the common colour-vision deficiencies (Okabe-Ito order).
STAGE_COLOURS = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#6b7686"]

theme = "light"  # the palette in use: "light" or "dark"
PAGE = SURFACE = SIDEBAR = BORDER = TEXT = MUTED = ACCENT = ACCENT_HOVER = ACCENT_PRESSED = ""
USER_BUBBLE = USER_TEXT = ASSISTANT_BUBBLE = CODE_BG = ERROR = ERROR_BG = OK = WARN = ""
DISABLED = HOVER = SELECTED = BUTTON = ""
CHAT_BODY_CSS = ""
STYLESHEET = ""


def stage_colour(i: int) -> str:
    return STAGE_COLOURS[i % len(STAGE_COLOURS)]


def app_icon() -> QIcon:
    return QIcon(str(ICON_PATH))


def icon(name: str, colour: str | None = None, size: int = 24) -> QIcon:
    """An SVG from assets/icons, its line colour swapped for `colour` (the
    sidebar icons follow the theme). Rendered at 1x and 2x for sharp HiDPI."""
    svg = (ICON_DIR / f"{name}.svg").read_text(encoding="utf-8")
    if colour:
        svg = svg.replace("#5b6678", colour).replace('fill="#ffffff"', f'fill="{SIDEBAR}"')
    renderer = QSvgRenderer(QByteArray(svg.encode()))
    out = QIcon()
    for scale in (1, 2, 3):
        pix = QPixmap(QSize(size * scale, size * scale))
        pix.fill(QColor(0, 0, 0, 0))
        painter = QPainter(pix)
        renderer.render(painter)
        painter.end()
        pix.setDevicePixelRatio(scale)
        out.addPixmap(pix)
    return out


def apply(name: str) -> None:
    """Switch the module's colours to `name` ("light" or "dark") and rebuild the stylesheet."""
    global theme, CHAT_BODY_CSS, STYLESHEET
    theme = "dark" if name == "dark" else "light"
    globals().update(DARK if theme == "dark" else LIGHT)
    CHAT_BODY_CSS = f"color:{TEXT}; background-color:{PAGE};"
    STYLESHEET = _stylesheet()


def palette() -> QPalette:
    """A QPalette to match, for the parts a stylesheet does not reach (menus, tooltips)."""
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: PAGE, QPalette.ColorRole.WindowText: TEXT,
        QPalette.ColorRole.Base: SURFACE, QPalette.ColorRole.AlternateBase: PAGE,
        QPalette.ColorRole.Text: TEXT, QPalette.ColorRole.Button: SURFACE,
        QPalette.ColorRole.ButtonText: TEXT, QPalette.ColorRole.Highlight: ACCENT,
        QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: SURFACE,
        QPalette.ColorRole.ToolTipText: TEXT, QPalette.ColorRole.PlaceholderText: MUTED,
        QPalette.ColorRole.Link: ACCENT,
    }
    for role, colour in roles.items():
        p.setColor(role, QColor(colour))
    p.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text, QColor(DISABLED))
    p.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText, QColor(DISABLED))
    p.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.WindowText, QColor(DISABLED))
    return p


def _stylesheet() -> str:
    return f"""
QMainWindow, QWidget#central, QStackedWidget > QWidget {{ background: {PAGE}; }}
QWidget {{ color: {TEXT}; font-size: 10.5pt; }}
QLabel#title {{ font-size: 15pt; font-weight: 600; }}
QLabel#code {{ font-size: 26pt; font-weight: 700; letter-spacing: 4px; color: {ACCENT}; padding: 8px; }}
QLabel#section {{ font-size: 11.5pt; font-weight: 600; margin-top: 6px; }}
QLabel#muted, QLabel#hint {{ color: {MUTED}; }}
QLabel#error {{ color: {ERROR}; }}
QLabel:disabled {{ color: {DISABLED}; }}
QFrame#banner {{ background: {ERROR_BG}; border: 1px solid {ERROR}; border-radius: 6px; }}
QFrame#banner QLabel {{ color: {ERROR}; }}
QFrame#card {{ background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 10px; }}
QFrame#card:disabled {{ background: {PAGE}; }}
QWidget#topBar {{ background: {SURFACE}; border-bottom: 1px solid {BORDER}; }}
QWidget#inputBar {{ background: {SURFACE}; border-top: 1px solid {BORDER}; }}
QWidget#sidebar {{ background: {SIDEBAR}; border-right: 1px solid {BORDER}; }}
QToolButton#nav {{
    border: 2px solid transparent; border-radius: 8px; padding: 6px 4px; font-size: 9pt;
    color: {MUTED}; background: transparent;
}}
QToolButton#nav:hover {{ background: {HOVER}; }}
QToolButton#nav:checked {{ background: {SELECTED}; color: {TEXT}; font-weight: 600; }}
QToolButton#nav:focus {{ border-color: {ACCENT}; }}
QTextBrowser#chatView {{ background: {PAGE}; border: none; }}
QTextBrowser#chatView:focus {{ border: 2px solid {ACCENT}; }}
QListWidget, QTreeWidget, QTableWidget {{
    background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 6px; outline: none;
}}
QListWidget::item, QTreeWidget::item {{ padding: 5px 6px; }}
QListWidget::item:selected, QTreeWidget::item:selected, QTableWidget::item:selected {{
    background: {SELECTED}; color: {TEXT};
}}
QListWidget:focus, QTreeWidget:focus, QTableWidget:focus {{ border: 2px solid {ACCENT}; }}
QHeaderView::section {{
    background: {PAGE}; color: {MUTED}; border: none; border-bottom: 1px solid {BORDER};
    padding: 5px 6px; font-weight: 600;
}}
QComboBox, QLineEdit, QSpinBox, QDoubleSpinBox {{
    background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 6px; padding: 4px 8px;
    selection-background-color: {ACCENT}; selection-color: white;
}}
QComboBox {{ min-width: 120px; }}
QComboBox:focus, QLineEdit:focus, QSpinBox:focus, QDoubleSpinBox:focus {{ border: 2px solid {ACCENT}; }}
QComboBox:disabled, QLineEdit:disabled, QSpinBox:disabled, QDoubleSpinBox:disabled {{
    color: {DISABLED}; background: {PAGE};
}}
/* Styling a spin box drops its native arrows: draw chevrons in two stacked buttons. */
QAbstractSpinBox {{ padding-right: 22px; }}
QAbstractSpinBox::up-button, QAbstractSpinBox::down-button {{
    subcontrol-origin: border; width: 20px; border: none; background: transparent;
}}
QAbstractSpinBox::up-button {{ subcontrol-position: top right; }}
QAbstractSpinBox::down-button {{ subcontrol-position: bottom right; }}
QAbstractSpinBox::up-arrow {{ image: url({_CHEVRON_UP}); width: 10px; height: 10px; }}
QAbstractSpinBox::down-arrow {{ image: url({_CHEVRON}); width: 10px; height: 10px; }}
QAbstractSpinBox::up-button:hover, QAbstractSpinBox::down-button:hover {{ background: {HOVER}; }}
QComboBox::drop-down {{ border: none; width: 26px; subcontrol-position: center right; }}
QComboBox::down-arrow {{ image: url({_CHEVRON}); width: 12px; height: 12px; }}
QComboBox QAbstractItemView {{
    background: {SURFACE}; border: 1px solid {BORDER};
    selection-background-color: {ACCENT}; selection-color: white; outline: none;
}}
QPlainTextEdit {{
    background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 8px; padding: 6px 8px;
    selection-background-color: {ACCENT}; selection-color: white;
}}
QPlainTextEdit:focus {{ border: 2px solid {ACCENT}; }}
QPlainTextEdit:disabled {{ background: {PAGE}; color: {MUTED}; }}
QPushButton {{
    border-radius: 7px; padding: 6px 14px; font-weight: 600;
    border: 1px solid {BORDER}; background: {SURFACE};
}}
QPushButton:hover {{ background: {HOVER}; }}
QPushButton:focus {{ border: 2px solid {ACCENT}; }}
QPushButton:disabled {{ color: {DISABLED}; background: {PAGE}; border-color: {BORDER}; }}
QPushButton#primary, QPushButton#send {{ background: {BUTTON}; color: white; border: 1px solid {BUTTON}; }}
QPushButton#primary:hover, QPushButton#send:hover {{ background: {ACCENT_HOVER}; }}
QPushButton#primary:pressed, QPushButton#send:pressed {{ background: {ACCENT_PRESSED}; }}
QPushButton#primary:focus, QPushButton#send:focus {{ border: 2px solid {TEXT}; }}
QPushButton#primary:disabled, QPushButton#send:disabled {{
    background: {BORDER}; border-color: {BORDER}; color: {DISABLED};
}}
QCheckBox:focus, QRadioButton:focus {{ color: {ACCENT}; }}
QCheckBox:disabled, QRadioButton:disabled {{ color: {DISABLED}; }}
QGroupBox {{
    border: 1px solid {BORDER}; border-radius: 8px; margin-top: 14px; padding: 10px 8px 8px 8px;
    background: {SURFACE};
}}
QGroupBox::title {{ subcontrol-origin: margin; left: 10px; padding: 0 4px; font-weight: 600; }}
QStatusBar {{ background: {SURFACE}; border-top: 1px solid {BORDER}; color: {MUTED}; }}
QStatusBar QLabel {{ color: {MUTED}; padding: 2px 8px; font-size: 9.5pt; }}
QProgressBar {{
    border: 1px solid {BORDER}; border-radius: 4px; background: {PAGE};
    min-height: 8px; max-height: 14px; text-align: center; font-size: 8pt;
}}
QProgressBar::chunk {{ background: {ACCENT}; border-radius: 3px; }}
QScrollArea {{ border: none; background: {PAGE}; }}
QToolTip {{ background: {SURFACE}; color: {TEXT}; border: 1px solid {BORDER}; padding: 4px; }}
"""


apply("light")


def scrolling_page(page: QWidget) -> QVBoxLayout:
    """Give a view its page body inside a vertical scroll area (small windows, large fonts);
    returns the body's layout, with the views' margins."""
    outer = QVBoxLayout(page)
    outer.setContentsMargins(0, 0, 0, 0)
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    body = QWidget()
    scroll.setWidget(body)
    outer.addWidget(scroll)
    root = QVBoxLayout(body)
    root.setContentsMargins(24, 18, 24, 18)
    return root
