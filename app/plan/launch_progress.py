"""The plan editor's launch progress: one row per stage (its peer and layers, a bar,
the phase), following the launcher's LaunchStep reports; a failed launch says on each
row whether its agent refused (and why) or the stage was stopped.
"""

from __future__ import annotations

from PySide6.QtWidgets import QGridLayout, QLabel, QProgressBar

from engine import client


class LaunchProgress(QGridLayout):
    def __init__(self) -> None:
        super().__init__()
        self._launch_rows: dict[int, tuple[QProgressBar, QLabel]] = {}

    def add_stage(self, i: int, title: str) -> None:
        """Row i, for the stage `title` names, waiting."""
        bar = QProgressBar()
        bar.setRange(0, 100)
        bar.setTextVisible(False)
        label = QLabel("waiting", objectName="muted")
        label.setWordWrap(True)  # a refusal's why with its numbers can be long
        self.addWidget(QLabel(title), i, 0)
        self.addWidget(bar, i, 1)
        self.addWidget(label, i, 2)
        self._launch_rows[i] = (bar, label)

    def clear_rows(self) -> None:
        while self.count():
            w = self.takeAt(0).widget()
            if w is not None:
                w.setParent(None)
                w.deleteLater()
        self._launch_rows = {}

    def show_step(self, step: client.LaunchStep) -> None:
        row = self._launch_rows.get(step.stage)
        if row is None:
            return
        bar, label = row
        bar.setValue({"waiting": 0, "transfer": 35, "compile": 70, "ready": 100}.get(step.phase, 0))
        label.setText(f"{step.phase}: {step.message}" if step.phase not in ("waiting", "ready")
                      else step.phase)

    def show_failed(self, refused: dict[int, str]) -> None:
        """The launch failed: `refused` maps a stage to why its agent said no; the rest stopped."""
        for i, (bar, label) in self._launch_rows.items():
            if i in refused:  # its agent said no: say why on its own row
                label.setText(f"refused: {refused[i]}")
                bar.setValue(0)
            elif label.text() != "ready":
                label.setText("stopped")
                bar.setValue(0)

    def phases(self) -> list[str]:
        """The phase text of every stage row (tests)."""
        return [label.text() for _bar, label in self._launch_rows.values()]
