"""Windows autostart through the registry, with winreg faked (it exists only on Windows):
the per-user Run value is written, seen and removed; Setup's machine-wide value is seen
but never touched (removing it needs admin rights: Setup/uninstall do it)."""

from __future__ import annotations

import sys
import types

import pytest

from installers import autostart


class _Key:
    def __init__(self, store: dict, path: tuple) -> None:
        self.store, self.path = store, path

    def __enter__(self) -> "_Key":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def fake_winreg() -> types.ModuleType:
    """The part of winreg autostart uses, over a dict {(hive, key): {name: (data, type)}}."""
    store: dict[tuple, dict] = {}
    m = types.ModuleType("winreg")
    m.HKEY_CURRENT_USER, m.HKEY_LOCAL_MACHINE = "HKCU", "HKLM"
    m.KEY_SET_VALUE, m.REG_SZ = 0x2, 1
    m.store = store

    def OpenKey(hive, sub, reserved=0, access=0):
        if (hive, sub) not in store:
            raise FileNotFoundError(2, "The system cannot find the file specified")
        return _Key(store, (hive, sub))

    def CreateKey(hive, sub):
        store.setdefault((hive, sub), {})
        return _Key(store, (hive, sub))

    def QueryValueEx(key, name):
        if name not in store[key.path]:
            raise FileNotFoundError(2, "The system cannot find the file specified")
        return store[key.path][name]

    def SetValueEx(key, name, reserved, kind, value):
        store[key.path][name] = (value, kind)

    def DeleteValue(key, name):
        if name not in store[key.path]:
            raise FileNotFoundError(2, "The system cannot find the file specified")
        del store[key.path][name]

    m.OpenKey, m.CreateKey, m.QueryValueEx = OpenKey, CreateKey, QueryValueEx
    m.SetValueEx, m.DeleteValue = SetValueEx, DeleteValue
    return m


@pytest.fixture
def winreg(monkeypatch):
    reg = fake_winreg()
    monkeypatch.setitem(sys.modules, "winreg", reg)
    return reg


def test_enable_writes_the_per_user_run_value_and_disable_removes_it(winreg):
    exe = r"C:\Program Files\Flotilla\flotilla-agent.exe"
    assert not autostart.is_enabled("win32")
    assert not autostart.disable("win32")  # nothing to remove: no error either
    where = autostart.enable([exe], platform="win32")
    assert where == autostart.entry_path("win32")
    run = winreg.store[("HKCU", autostart.WIN_RUN_KEY)]
    assert run[autostart.WIN_RUN_VALUE] == (f'"{exe}"', winreg.REG_SZ)  # quoted: the path has a space
    assert autostart.is_enabled("win32")
    assert autostart.disable("win32")
    assert autostart.WIN_RUN_VALUE not in run and not autostart.is_enabled("win32")


def test_setups_machine_wide_value_counts_but_is_left_to_setup(winreg):
    hklm = winreg.store.setdefault(("HKLM", autostart.WIN_RUN_KEY), {})
    hklm[autostart.WIN_RUN_VALUE] = ("flotilla-agent.exe", winreg.REG_SZ)
    assert autostart.is_enabled("win32")  # Setup's "start at every login" task
    assert not autostart.disable("win32")  # nothing per-user to remove ...
    assert autostart.WIN_RUN_VALUE in hklm  # ... and the machine-wide value is untouched
