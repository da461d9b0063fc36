"""The sharing-policy form (when this PC may be lent to the fleet), shared by
the Settings view and the tray's Policy… dialog. Plain widgets: the owner
loads and saves the dict (engine.client.load/save_sharing_policy, or an
AgentHandle's) on the Runner."""

from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QWidget


class PolicyForm(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        self.share_enabled = QCheckBox("Lend this PC to the fleet when it is idle")
        self.idle_minutes = QDoubleSpinBox(minimum=0, maximum=1440, decimals=0, suffix=" min")
        self.idle_minutes.setAccessibleName("Idle minutes before sharing")
        self.require_ac = QCheckBox("Only on mains power (never on battery)")
        self.max_ram = QDoubleSpinBox(minimum=0, maximum=4096, decimals=1, suffix=" GB")
        self.max_ram.setAccessibleName("RAM the fleet may use")
        devs = QHBoxLayout()
        self.device_checks = {d: QCheckBox(d) for d in ("CPU", "GPU", "NPU")}
        for c in self.device_checks.values():
            devs.addWidget(c)
        devs.addStretch(1)
        self.yield_back = QCheckBox("Stop fleet work within 2 s when I come back")
        form.addRow(self.share_enabled)
        form.addRow("Idle for at least", self.idle_minutes)
        form.addRow(self.require_ac)
        form.addRow("RAM the fleet may use", self.max_ram)
        form.addRow("Devices", devs)
        form.addRow(self.yield_back)
        self._policy: dict = {}

    def set_policy(self, p: dict) -> None:
        self.share_enabled.setChecked(bool(p.get("enabled", True)))
        self.idle_minutes.setValue(float(p.get("idle_minutes", 5)))
        self.require_ac.setChecked(bool(p.get("require_ac", True)))
        self.max_ram.setValue(float(p.get("max_ram_gb", 8)))
        for d, c in self.device_checks.items():
            c.setChecked(d in p.get("devices", []))
        self.yield_back.setChecked(bool(p.get("yield_on_return", True)))
        self._policy = dict(p)

    def policy(self) -> dict:
        """The policy as edited (fields the form does not show are kept)."""
        p = dict(self._policy)
        p.update(enabled=self.share_enabled.isChecked(), idle_minutes=self.idle_minutes.value(),
                 require_ac=self.require_ac.isChecked(), max_ram_gb=self.max_ram.value(),
                 devices=[d for d, c in self.device_checks.items() if c.isChecked()],
                 yield_on_return=self.yield_back.isChecked())
        return p
