"""Build recipes for Flotilla's installers (PyInstaller bundle, .deb, Setup.exe, .dmg).

Nothing here is imported by engine/ or app/ at run time, except autostart.py,
which the frozen bundle also carries (see docs/install.md).
"""
