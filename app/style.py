"""Colours, the window stylesheet and the app icon, in one place so the chat,
the fleet view and the plan editor look like one app.

A light palette with one accent (a sea blue). Contrast: body text on the
bubbles is at least 7:1; muted text at least 4.5:1 on the page background.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QIcon

ICON_DIR = Path(__file__).resolve().parent.parent / "assets" / "icons"
ICON_PATH = ICON_DIR / "flotilla.svg"
# QSS wants forward slashes, also on Windows.
_CHEVRON = (ICON_DIR / "chevron-down.svg").as_posix()

PAGE = "#f5f7fa"  # window and transcript background
SURFACE = "#ffffff"  # input, combo box
BORDER = "#d5dbe3"
TEXT = "#1c2430"
MUTED = "#5b6678"
ACCENT = "#1f6feb"
ACCENT_HOVER = "#1a5fd0"
ACCENT_PRESSED = "#174fae"
USER_BUBBLE = ACCENT
USER_TEXT = "#ffffff"
ASSISTANT_BUBBLE = "#e6ebf2"
ERROR = "#b42318"

CHAT_BODY_CSS = f"color:{TEXT}; background-color:{PAGE};"


def app_icon() -> QIcon:
    return QIcon(str(ICON_PATH))


STYLESHEET = f"""
QMainWindow, QWidget#central {{ background: {PAGE}; }}
QWidget {{ color: {TEXT}; font-size: 10.5pt; }}
QLabel#title {{ font-size: 13pt; font-weight: 600; }}
QLabel#muted {{ color: {MUTED}; }}
QWidget#topBar {{ background: {SURFACE}; border-bottom: 1px solid {BORDER}; }}
QWidget#inputBar {{ background: {SURFACE}; border-top: 1px solid {BORDER}; }}
QTextBrowser#chatView {{ background: {PAGE}; border: none; }}
QComboBox {{
    background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 6px;
    padding: 4px 10px; min-width: 160px;
}}
QComboBox:focus {{ border-color: {ACCENT}; }}
/* Styling QComboBox drops the native arrow: draw our own chevron. */
QComboBox::drop-down {{ border: none; width: 26px; subcontrol-position: center right; }}
QComboBox::down-arrow {{ image: url({_CHEVRON}); width: 12px; height: 12px; }}
QComboBox QAbstractItemView {{
    background: {SURFACE}; border: 1px solid {BORDER};
    selection-background-color: {ACCENT}; selection-color: white; outline: none;
}}
QPlainTextEdit#prompt {{
    background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 8px;
    padding: 6px 8px; selection-background-color: {ACCENT};
}}
QPlainTextEdit#prompt:focus {{ border-color: {ACCENT}; }}
QPlainTextEdit#prompt:disabled {{ background: {PAGE}; color: {MUTED}; }}
QPushButton {{
    border-radius: 8px; padding: 8px 18px; font-weight: 600;
    border: 1px solid {BORDER}; background: {SURFACE};
}}
QPushButton:hover {{ background: #eef2f7; }}
QPushButton:disabled {{ color: #9aa4b2; background: {PAGE}; border-color: #e3e7ed; }}
QPushButton#send {{ background: {ACCENT}; color: white; border: 1px solid {ACCENT}; }}
QPushButton#send:hover {{ background: {ACCENT_HOVER}; }}
QPushButton#send:pressed {{ background: {ACCENT_PRESSED}; }}
QPushButton#send:disabled {{ background: #a9c4f0; border-color: #a9c4f0; color: #f3f7fd; }}
QStatusBar {{ background: {SURFACE}; border-top: 1px solid {BORDER}; color: {MUTED}; }}
QStatusBar QLabel {{ color: {MUTED}; padding: 3px 8px; font-size: 9.5pt; }}
QProgressBar {{
    border: 1px solid {BORDER}; border-radius: 4px; background: {PAGE};
    max-height: 10px; min-width: 140px; text-align: center;
}}
QProgressBar::chunk {{ background: {ACCENT}; border-radius: 3px; }}
"""
