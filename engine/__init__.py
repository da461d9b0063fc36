"""Flotilla's headless engines. Never imports PySide6 or app."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flotilla")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0.1.0"
