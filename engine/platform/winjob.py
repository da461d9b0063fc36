"""Windows: a Job object whose processes are killed when its last handle closes.

The fleet agent puts its shard workers in one (engine/platform/process.py
kill_with_this_process). Only this process holds the job's handle, and Windows closes every
handle of a process that ends, however it ends -- TerminateProcess (the Task Manager's
"End task") runs no Python cleanup at all -- so the workers die with the agent.

Imported only on Windows (process.py imports it inside its Windows branch). The structures
are plain ctypes, so tests load this module on any OS and drive it with a faked kernel32.
"""

from __future__ import annotations

import ctypes
from typing import Any

JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS = 9  # JobObjectExtendedLimitInformation
JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x00002000
PROCESS_TERMINATE = 0x0001
PROCESS_SET_QUOTA = 0x0100  # both rights are what AssignProcessToJobObject needs

# Windows' own widths (ctypes.wintypes.DWORD is 8 bytes on 64-bit Linux: not used here).
DWORD = ctypes.c_uint32
LARGE_INTEGER = ctypes.c_int64
ULONGLONG = ctypes.c_uint64
SIZE_T = ctypes.c_size_t
ULONG_PTR = ctypes.c_size_t
HANDLE = ctypes.c_void_p
BOOL = ctypes.c_int32


class JOBOBJECT_BASIC_LIMIT_INFORMATION(ctypes.Structure):  # noqa: N801 - the Windows name
    _fields_ = [("PerProcessUserTimeLimit", LARGE_INTEGER), ("PerJobUserTimeLimit", LARGE_INTEGER),
                ("LimitFlags", DWORD), ("MinimumWorkingSetSize", SIZE_T), ("MaximumWorkingSetSize", SIZE_T),
                ("ActiveProcessLimit", DWORD), ("Affinity", ULONG_PTR), ("PriorityClass", DWORD),
                ("SchedulingClass", DWORD)]


class IO_COUNTERS(ctypes.Structure):  # noqa: N801
    _fields_ = [(name, ULONGLONG) for name in ("ReadOperationCount", "WriteOperationCount",
                                               "OtherOperationCount", "ReadTransferCount",
                                               "WriteTransferCount", "OtherTransferCount")]


class JOBOBJECT_EXTENDED_LIMIT_INFORMATION(ctypes.Structure):  # noqa: N801
    _fields_ = [("BasicLimitInformation", JOBOBJECT_BASIC_LIMIT_INFORMATION), ("IoInfo", IO_COUNTERS),
                ("ProcessMemoryLimit", SIZE_T), ("JobMemoryLimit", SIZE_T),
                ("PeakProcessMemoryUsed", SIZE_T), ("PeakJobMemoryUsed", SIZE_T)]


class WinJobError(OSError):
    """A Job object call failed. .code: which step ("create", "limit", "open", "assign");
    .winerror: GetLastError()."""

    def __init__(self, code: str, winerror: int) -> None:
        super().__init__(f"Job object {code} failed (Windows error {winerror}) [job_{code}]")
        self.code, self.winerror = code, winerror


def _last_error() -> int:
    """GetLastError() of the last call made through load_kernel32() (use_last_error)."""
    get = getattr(ctypes, "get_last_error", None)  # Windows only
    return int(get()) if get is not None else 0


def load_kernel32() -> Any:
    """kernel32 with the signatures used here (Windows only: ctypes.WinDLL)."""
    k = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    k.CreateJobObjectW.argtypes, k.CreateJobObjectW.restype = [ctypes.c_void_p, ctypes.c_wchar_p], HANDLE
    k.SetInformationJobObject.argtypes = [HANDLE, ctypes.c_int, ctypes.c_void_p, DWORD]
    k.SetInformationJobObject.restype = BOOL
    k.OpenProcess.argtypes, k.OpenProcess.restype = [DWORD, BOOL, DWORD], HANDLE
    k.AssignProcessToJobObject.argtypes, k.AssignProcessToJobObject.restype = [HANDLE, HANDLE], BOOL
    k.CloseHandle.argtypes, k.CloseHandle.restype = [HANDLE], BOOL
    return k


class KillOnCloseJob:
    """A Job object with JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE. add(pid) puts a process in it
    (its later children join by themselves); close() -- or this process ending -- kills them."""

    def __init__(self, kernel32: Any = None) -> None:
        self._k = kernel32 if kernel32 is not None else load_kernel32()
        handle = self._k.CreateJobObjectW(None, None)
        if not handle:
            raise WinJobError("create", _last_error())
        info = JOBOBJECT_EXTENDED_LIMIT_INFORMATION()
        info.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
        if not self._k.SetInformationJobObject(handle, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS,
                                               ctypes.byref(info), ctypes.sizeof(info)):
            err = _last_error()
            self._k.CloseHandle(handle)
            raise WinJobError("limit", err)
        self.handle = handle

    def add(self, pid: int) -> None:
        """Put process pid into the job. WinJobError if it cannot be opened or assigned."""
        proc = self._k.OpenProcess(PROCESS_SET_QUOTA | PROCESS_TERMINATE, False, pid)
        if not proc:
            raise WinJobError("open", _last_error())
        try:
            if not self._k.AssignProcessToJobObject(self.handle, proc):
                raise WinJobError("assign", _last_error())
        finally:
            self._k.CloseHandle(proc)

    def close(self) -> None:
        """Close the job's handle: every process still in it is killed. Idempotent."""
        if self.handle:
            handle, self.handle = self.handle, None
            self._k.CloseHandle(handle)
