"""Where the app keeps its files, and the sharing policy the fleet agent obeys."""

from __future__ import annotations

from pathlib import Path


def config_dir() -> Path:
    """$FLOTILLA_CONFIG, else the platform's per-user config folder (created)."""
    from engine.fleet.paths import config_dir as cfg

    return cfg()


def settings_dir() -> Path:
    """The app's preferences folder (app_settings.json): engine.paths.settings_dir()."""
    from engine.paths import settings_dir as settings

    return settings()


def data_dir() -> Path:
    """Where the app keeps conversations: engine.paths.history_dir() ($FLOTILLA_DATA, else
    the platform's per-user history folder), created if missing."""
    from engine.paths import history_dir

    return history_dir()


def sharing_policy_path() -> Path:
    """THE sharing-policy file: <keys folder>/sharing_policy.json (engine/paths.py), i.e.
    $FLOTILLA_CONFIG/sharing_policy.json or, by default,
    ~/.config/flotilla/keys/sharing_policy.json (Linux),
    %LOCALAPPDATA%\\flotilla\\keys\\sharing_policy.json (Windows),
    ~/Library/Application Support/flotilla/keys/sharing_policy.json (macOS).
    The app's Settings view writes it; the fleet agent (engine.fleet.policy.
    SharingPolicy.load) reads it and reloads it when it changes. Fields:
    enabled, idle_minutes, require_ac, max_ram_gb, devices, yield_on_return,
    max_cpu_percent_to_start."""
    from engine.fleet.policy import POLICY_FILE

    return config_dir() / POLICY_FILE


def load_sharing_policy(config: Path | None = None) -> dict:
    """The policy as a plain dict (defaults for a missing or broken file)."""
    import dataclasses

    from engine.fleet.policy import SharingPolicy

    d = dataclasses.asdict(SharingPolicy.load(config or config_dir()))
    d["devices"] = list(d["devices"])
    return d


def save_sharing_policy(policy: dict, config: Path | None = None) -> Path:
    """Validate and write the policy atomically; ValueError for bad values."""
    import dataclasses

    from engine.fleet.policy import POLICY_FILE, SharingPolicy

    names = {f.name for f in dataclasses.fields(SharingPolicy)}
    kw = {k: (tuple(v) if k == "devices" else v) for k, v in policy.items() if k in names}
    folder = config or config_dir()
    SharingPolicy(**kw).save(folder)
    return folder / POLICY_FILE
