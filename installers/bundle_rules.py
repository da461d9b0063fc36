"""What goes into the frozen bundle and what is left out, in one place.

Used by installers/flotilla.spec (all OSes); docs/install.md and the README's
size note describe the same lists. Each rule says why: a file left out must be
one Flotilla never loads at run time.

Paths are matched against a file's destination inside the bundle (forward
slashes, relative to the bundle's _internal folder) with fnmatch.
"""

from __future__ import annotations

import fnmatch

# Python packages never imported by `flotilla`, its app or its agent at run time.
EXCLUDED_MODULES = [
    # optimum-intel drags torchvision in; its PyPI build is CUDA-only and breaks
    # beside CPU torch (the Makefile uninstalls it too). Audio/text siblings alike.
    "torchvision", "torchaudio", "torchtext",
    # CUDA and GPU compilers: Flotilla runs torch on the CPU only (OpenVINO does GPU/NPU).
    "triton", "nvidia", "cuda", "cupy", "jax", "jaxlib", "tensorflow", "keras",
    "torch.utils.tensorboard", "tensorboard",
    # transformers' optional extras that `import transformers` probes but that
    # only vision/audio/eval pipelines use (scikit-learn: ~50 MB; SciPy stays:
    # NNCF, which optimum-intel imports for every export, needs scipy.linalg).
    "sklearn", "PIL", "cv2", "librosa", "soundfile", "av", "timm",
    "pandas", "pyarrow", "datasets", "evaluate", "accelerate",
    # benchmark plots (docs/) are made from a checkout, not from the installers.
    "matplotlib", "fontTools", "kiwisolver", "contourpy", "cycler",
    # OpenVINO GenAI: the engines drive openvino directly. Python bindings of the
    # frontends whose libraries are left out (see EXCLUDED_FILES).
    "openvino_genai", "openvino.frontend.onnx", "openvino.frontend.tensorflow",
    "openvino.frontend.paddle", "openvino.frontend.jax",
    # test, dev and notebook tooling.
    "pytest", "_pytest", "hypothesis", "importlinter", "grimp", "openai", "IPython",
    "ipykernel", "jupyter_client", "notebook", "tkinter", "_tkinter", "pydoc_data",
    "setuptools", "pip", "wheel", "PyInstaller",
    # Qt modules the app does not import (the PySide6 hooks follow imports
    # only, these stop stray references).
    "PySide6.QtQml", "PySide6.QtQuick", "PySide6.QtQuickWidgets", "PySide6.QtNetwork",
    "PySide6.QtOpenGL", "PySide6.QtOpenGLWidgets", "PySide6.QtPrintSupport", "PySide6.QtSql",
    "PySide6.QtTest", "PySide6.QtDesigner", "PySide6.QtUiTools", "PySide6.QtHelp",
    "PySide6.QtXml", "PySide6.QtConcurrent",
]

# Files dropped after analysis (destination paths inside the bundle).
EXCLUDED_FILES = [
    # torch: C++ test binaries and test data, headers, CMake files, protoc, the
    # test-only libraries (~190 MB on Linux x86_64, torch 2.13).
    "torch/test/*", "torch/bin/*", "torch/include/*", "torch/share/*",
    "torch/lib/libjitbackend_test*", "torch/lib/libtorchbind_test*",
    "torch/lib/libbackend_with_compiler*", "torch/lib/libaoti_custom_ops*",
    "torch/testing/_internal/data/*", "torch/_inductor/codegen/aoti_runtime/*",
    "*.pyi", "*.h", "*.hpp", "*.cuh", "*.cmake", "*.a", "*.lib",
    # OpenVINO: frontends Flotilla never reads (it reads IR, and converts torch
    # models with the PyTorch frontend), headers. (lib prefix/suffix differ per OS.)
    "openvino/libs/*openvino_onnx_frontend*", "openvino/libs/*openvino_paddle_frontend*",
    "openvino/libs/*openvino_tensorflow_frontend*", "openvino/libs/*openvino_tensorflow_lite_frontend*",
    "openvino/libs/*openvino_jax_frontend*", "openvino/include/*", "openvino/frontend/onnx/*",
    "openvino/frontend/tensorflow/*", "openvino/frontend/paddle/*", "openvino/frontend/jax/*",
    # Qt: QML, Quick, designer and friends (no QML in the app), translations
    # but Qt's own base strings, plugins for hardware the desktop app never
    # targets (framebuffer/KMS/VNC, touch/tablet input, printing, SQL).
    # `PySide6/*x` covers PySide6/Qt/lib (Linux, macOS frameworks) and PySide6/ (Windows DLLs).
    "PySide6/*qml/*", "PySide6/*metatypes/*", "PySide6/*libexec/*", "PySide6/*translations/*",
    "PySide6/*Qt6Quick*", "PySide6/*Qt6Qml*", "PySide6/*Qt6Designer*", "PySide6/*Qt6Labs*",
    "PySide6/*Qt6Lottie*", "PySide6/*Qt6WaylandCompositor*", "PySide6/*Qt6WaylandEglCompositor*",
    "PySide6/*Qt6Test*", "PySide6/*Qt6Sql*", "PySide6/*Qt6Help*", "PySide6/*Qt6PrintSupport*",
    "PySide6/*Qt6UiTools*", "PySide6/*Qt6EglFs*", "PySide6/*Qt6EglFSDeviceIntegration*",
    "PySide6/*/QtQuick*.framework/*", "PySide6/*/QtQml*.framework/*", "PySide6/*/QtDesigner*.framework/*",
    "PySide6/*plugins/platforms/*qeglfs*", "PySide6/*plugins/platforms/*qlinuxfb*",
    "PySide6/*plugins/platforms/*qvnc*", "PySide6/*plugins/platforms/*qvkkhrdisplay*",
    "PySide6/*plugins/platforms/*qminimalegl*", "PySide6/*plugins/egldeviceintegrations/*",
    "PySide6/*plugins/generic/*", "PySide6/*plugins/printsupport/*", "PySide6/*plugins/sqldrivers/*",
    "PySide6/*plugins/qmltooling/*", "PySide6/*plugins/qmllint/*", "PySide6/*plugins/designer/*",
    "PySide6/*plugins/wayland-graphics-integration-server/*",
    "PySide6/*plugins/platforminputcontexts/*qtvirtualkeyboard*",
    "PySide6/*plugins/imageformats/*qpdf*", "PySide6/*plugins/imageformats/*qtiff*",
    "PySide6/*plugins/imageformats/*qwebp*", "PySide6/*plugins/imageformats/*qtga*",
    "PySide6/*plugins/imageformats/*qwbmp*", "PySide6/*plugins/imageformats/*qgif*",
    # the GTK3 platform theme drags the whole GTK/cairo/pango stack in; the app
    # draws itself with Fusion anyway (xdgdesktopportal stays for native dialogs).
    "PySide6/*plugins/platformthemes/*qgtk3*",
    # CUDA runtime libraries found on the build machine: Flotilla never uses CUDA.
    "libcuda*", "libcudart*", "libcublas*", "libcudnn*", "libnvrtc*", "libnvJitLink*", "libcufft*",
    "libcurand*", "libcusparse*", "libcusolver*", "libnccl*", "libhiprtc*", "libamdhip*",
    # transformers: the docs bundled as package data, never read.
    "transformers/*.md",
]

# Linux only: system libraries the desktop provides, taken from the system and
# not bundled (the .deb depends on their packages, computed from the bundle's
# ELF files by installers/linux/deb.py). A bundled libstdc++ older than the
# system's breaks Mesa's GL drivers; bundled X11/xcb/fontconfig/glib/dbus must
# match the running desktop anyway.
LINUX_SYSTEM_LIBS = [
    "libstdc++.so*", "libgcc_s.so*", "libX11*.so*", "libXau.so*", "libXdmcp.so*", "libXext.so*",
    "libXrender.so*", "libXss.so*", "libxcb*.so*", "libxkbcommon*.so*", "libfontconfig.so*",
    "libfreetype.so*", "libpng16.so*", "libbrotli*.so*", "libexpat.so*", "libdbus-1.so*",
    "libsystemd.so*", "libglib-2.0.so*", "libgobject-2.0.so*", "libgio-2.0.so*", "libgmodule-2.0.so*",
    "libgthread-2.0.so*", "libpcre2-8.so*", "libmount.so*", "libblkid.so*", "libselinux.so*",
    "libffi.so*", "libwayland-*.so*", "libGL*.so*", "libEGL*.so*", "libOpenGL.so*", "libdrm*.so*",
    "libgbm.so*", "libgcrypt.so*", "libgpg-error.so*", "libcap.so*", "liblz4.so*", "libzstd.so*",
    "liblzma.so*", "libbsd.so*", "libmd.so*",
    # the GTK stack, orphaned once the GTK3 theme plugin is out (nothing else needs it).
    "libgtk-3.so*", "libgdk-3.so*", "libatk*.so*", "libatspi.so*", "libcairo*.so*", "libpango*.so*",
    "libgdk_pixbuf*.so*", "libharfbuzz*.so*", "libfribidi.so*", "libthai.so*", "libdatrie.so*",
    "libgraphite2.so*", "libpixman-1.so*", "libjpeg.so*", "libepoxy.so*",
]

# Linux only: libraries shipped with their symbols, stripped after the build
# (strip --strip-unneeded). A list, not every file: stripping a library that
# auditwheel/patchelf rewrote (numpy.libs, *.libs) makes it unloadable.
# libtorch_cpu 434 -> 345 MB, libpython 23 -> 5.5 MB.
STRIP_LINUX = [
    "torch/lib/libtorch_cpu.so", "torch/lib/libtorch_python.so", "torch/lib/libc10.so",
    "libpython3*.so*", "uvloop/*.so", "hf_xet/*.so", "tokenizers/*.so", "safetensors/*.so",
    "PySide6/Qt/lib/libicu*.so*",
]

# Kept although an EXCLUDED_FILES pattern matches.
KEPT_FILES = [
    "PySide6/*translations/qtbase_*",  # Qt's own dialog/button strings
    "torch/bin/torch_shm_manager*",  # `import torch` checks that it exists
]

# Files the bundle must have, or the app/agent fails at run time on Linux; the
# build checks them after collecting (destination paths, fnmatch).
REQUIRED_FILES_LINUX = [
    "assets/demo/corpus.txt",
    "assets/demo/trained/*/model.safetensors",
    "assets/icons/flotilla.svg",
    "flotilla-*.dist-info/entry_points.txt",
    "openvino/libs/libopenvino.so*",
    "openvino/libs/libopenvino_intel_cpu_plugin.so",
    "openvino/libs/libopenvino_ir_frontend.so*",
    "openvino/libs/libopenvino_pytorch_frontend.so*",
    "PySide6/Qt/plugins/platforms/libqxcb.so",
    "PySide6/Qt/plugins/platforms/libqwayland.so",
    "PySide6/Qt/plugins/platforms/libqoffscreen.so",
    "PySide6/Qt/plugins/imageformats/libqsvg.so",
    "PySide6/Qt/plugins/iconengines/libqsvgicon.so",
    "torch/lib/libtorch_cpu.so",
]


def excluded(dest: str, linux: bool = False) -> bool:
    """True if a file with this destination path is left out of the bundle."""
    dest = dest.replace("\\", "/")
    if linux and "/" not in dest and any(fnmatch.fnmatch(dest, pat) for pat in LINUX_SYSTEM_LIBS):
        return True
    return (any(fnmatch.fnmatch(dest, pat) for pat in EXCLUDED_FILES)
            and not any(fnmatch.fnmatch(dest, pat) for pat in KEPT_FILES))


def filter_toc(toc, linux: bool = False):
    """A PyInstaller TOC (datas or binaries) without the excluded files, nor
    symbolic links to them (PyInstaller links some libraries to the top level)."""
    def keep(entry) -> bool:
        dest, src, kind = entry[0], entry[1], entry[2]
        if excluded(dest, linux):
            return False
        return not (kind == "SYMLINK" and excluded(str(src), linux))
    return [entry for entry in toc if keep(entry)]
