"""Flotilla's desktop app (PySide6). The only package that imports Qt; it
reaches engines only through engine.client and engine.protocol."""
