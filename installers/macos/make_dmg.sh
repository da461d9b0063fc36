#!/usr/bin/env bash
# Flotilla for macOS: Flotilla.app (PyInstaller BUNDLE, installers/flotilla.spec, with the
# agent moved into its helper bundle Contents/Helpers/Flotilla Agent.app by installers/build.py)
# -> Flotilla-<version>-<arch>.dmg with the usual "drag to Applications" window.
#
#   python -m installers.build --bundle-only     # builds build/dist-cache/<key>/bundle/Flotilla.app
#   installers/macos/make_dmg.sh PATH/TO/Flotilla.app [OUT_DIR]
#
# Needs only what macOS ships (hdiutil, codesign). Signing: set
# CODESIGN_IDENTITY="Developer ID Application: ..." to sign with the hardened
# runtime; without it the app is ad-hoc signed and users open it the first time
# with right-click > Open (docs/install.md). Notarization (xcrun notarytool)
# needs an Apple account and is left to the release manager.
set -euo pipefail
app="${1:?usage: make_dmg.sh Flotilla.app [OUT_DIR]}"
out="${2:-dist}"
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
version="$(cd "$repo" && python3 -m installers.project version)"   # from pyproject.toml
arch="$(uname -m)"
mkdir -p "$out"
dmg="$out/Flotilla-${version}-${arch}.dmg"

# The agent must be in its own LSUIElement helper bundle (installers/macapp.py, run by installers/build.py).
(cd "$repo" && python3 -m installers.macapp check "$app")

# The bundle's version must be the project's (Info.plist is written by the spec).
plist_version="$(/usr/libexec/PlistBuddy -c 'Print :CFBundleShortVersionString' "$app/Contents/Info.plist")"
[ "$plist_version" = "$version" ] || { echo "Info.plist says $plist_version, pyproject $version" >&2; exit 1; }

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
  codesign --force --deep --options runtime --timestamp --sign "$CODESIGN_IDENTITY" "$app"
else
  codesign --force --deep --sign - "$app"
fi
codesign --verify --deep --strict "$app"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp -R "$app" "$stage/Flotilla.app"
ln -s /Applications "$stage/Applications"
rm -f "$dmg"
hdiutil create -volname "Flotilla ${version}" -srcfolder "$stage" -fs HFS+ -format UDZO \
  -imagekey zlib-level=9 -ov "$dmg"
echo "built $dmg ($(du -h "$dmg" | cut -f1))"
