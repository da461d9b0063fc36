"""The plan editor's "Engine settings" box: context, streams, weight precision,
speculative decoding (mode, draft model, K, adaptive), stage recovery, the exact
prompt cache and the MoE / sparse cache budget. The editor (app/plan/view.py) reacts to its changes and
decides what is offered (plan_rules.spec_blocker); this box only shows it.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QComboBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QSpinBox, QWidget

from engine import client


class EngineSettings(QGroupBox):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Engine settings", parent)
        form = QFormLayout(self)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        self.context = QSpinBox(minimum=256, maximum=1_048_576, singleStep=1024, value=4096, suffix=" tokens")
        self.streams = QSpinBox(minimum=1, maximum=64, value=4)
        self.streams.setToolTip("Concurrent conversations; each keeps its own KV cache on every stage")
        self.weights_box = QComboBox()
        self.weights_box.setAccessibleName("Weight precision")
        tips = {"auto": "The most precise precision at which this plan fits, starting at the model's own dtype",
                "f32": "Full precision: 4 bytes a weight", "bf16": "16-bit brain float: 2 bytes a weight",
                "fp16": "16-bit float: 2 bytes a weight", "int8": "8-bit weights (per-channel): 1 byte a weight",
                "int4": "4-bit weights (grouped): half a byte a weight, for models bigger than the fleet's RAM"}
        for label in client.WEIGHT_CHOICES:
            self.weights_box.addItem(label, label)
            self.weights_box.setItemData(self.weights_box.count() - 1, tips.get(label, label),
                                         Qt.ItemDataRole.ToolTipRole)
        self.weights_box.setToolTip("Weight precision of every shard: part of the plan (memory bars are at it)")
        spec_row = QHBoxLayout()
        self.spec_mode = QComboBox()
        self.spec_mode.setAccessibleName("Speculative decoding")
        for label, mode in (("Off", "off"), ("Draft model", "draft"), ("Prompt lookup", "lookup")):
            self.spec_mode.addItem(label, mode)
        self.spec_mode.setItemData(1, "A small draft model proposes K tokens; the target checks them in one "
                                      "pass (answers are identical)", Qt.ItemDataRole.ToolTipRole)
        self.spec_mode.setItemData(2, "Drafts from earlier text of the conversation: no model, pays off on "
                                      "repetitive text", Qt.ItemDataRole.ToolTipRole)
        self.draft_box = QComboBox()
        self.draft_box.setEditable(True)
        self.draft_box.setAccessibleName("Draft model")
        self.draft_box.setToolTip("The draft model (it must share the target's tokenizer)")
        self.draft_box.setMinimumContentsLength(12)
        self.spec_k = QSpinBox(minimum=1, maximum=client.SPEC_MAX_K, value=4, prefix="K = ")
        self.spec_k.setAccessibleName("Drafted tokens per step")
        self.spec_k.setToolTip("Drafted tokens per step (the start value when adaptive)")
        self.spec_adaptive = QCheckBox("adaptive")
        self.spec_adaptive.setChecked(True)
        self.spec_adaptive.setToolTip("Adapt K to the running acceptance rate")
        for w in (self.spec_mode, self.draft_box, self.spec_k, self.spec_adaptive):
            spec_row.addWidget(w)
        spec_row.addStretch(1)
        self.recover = QCheckBox("Recover a lost stage (warm standby process)")
        self.recover.setChecked(True)
        self.recover.setToolTip("When a stage process dies, a standby takes over and every answer "
                                "continues (engine/pipeline/recovery.py)")
        self.exact_cache = QCheckBox("Follow-up answers exactly as uncached (16-bit KV cache)")
        self.exact_cache.setToolTip("A follow-up turn reuses the stages' KV in whole prefill chunks only, and "
                                    "every stage keeps a 16-bit KV cache instead of its device's default (the plan's "
                                    "memory counts it): its answer is the one a fresh request gets")
        self.cache_budget = QSpinBox(minimum=0, maximum=1_000_000, singleStep=256, value=0,
                                     suffix=" MB", specialValueText="automatic (from free RAM)")
        self.cache_budget.setToolTip("RAM for the MoE expert cache or the sparse neuron cache")
        self.spec_reason = QLabel("", objectName="hint")
        self.spec_reason.setWordWrap(True)
        form.addRow("Context length", self.context)
        form.addRow("Streams", self.streams)
        weights_row = QHBoxLayout()
        weights_row.addWidget(self.weights_box)
        self.weights_used = QLabel("", objectName="muted")  # what "auto" resolved to, beside the choice
        weights_row.addWidget(self.weights_used)
        weights_row.addStretch(1)
        form.addRow("Weights", weights_row)
        form.addRow("Speculative decoding", spec_row)
        form.addRow("", self.spec_reason)
        form.addRow("Reliability", self.recover)
        form.addRow("Prompt cache", self.exact_cache)
        form.addRow("Cache budget", self.cache_budget)

    def weights_choice(self) -> str:
        """"auto" or a precision label (client.WEIGHT_CHOICES)."""
        return self.weights_box.currentData() or "auto"

    def speculative_choice(self) -> client.SpecChoice | None:
        mode = self.spec_mode.currentData()
        if mode == "off" or not self.spec_mode.isEnabled():
            return None
        return client.SpecChoice(mode, self.spec_k.value(), self.spec_adaptive.isChecked(),
                                 self.draft_box.currentText().strip() or None)

    def show_spec(self, why: str) -> None:
        """Offer speculative decoding, or disable it saying why (why "" = offered)."""
        self.spec_mode.setEnabled(not why)
        on = not why and self.spec_mode.currentData() != "off"
        self.draft_box.setEnabled(on and self.spec_mode.currentData() == "draft")
        self.spec_k.setEnabled(on)
        self.spec_adaptive.setEnabled(on)
        self.spec_mode.setToolTip(why or "Draft tokens cheaply and verify them in one pass of the model")
        self.spec_reason.setVisible(bool(why) or self.spec_mode.currentData() != "off")
        self.spec_reason.setText(f"Not available here: {why}" if why else
                                 ("Lookup needs no model; answers are identical either way."
                                  if self.spec_mode.currentData() == "lookup" else
                                  "Answers are identical; the draft runs on this PC." if on else ""))
