"""The plan editor: pick a model, an engine and peers; see and edit how the
layers are split; launch.

The planner (engine/pipeline/plan.py, through engine.client) is pure and
fast, so edits (drag a boundary, pick a device, change the context) are
re-evaluated right here for live feedback; Auto-plan, which searches every
peer order, runs on the Runner. The editor always keeps a plan on screen:
an edit that overflows memory is drawn red with the planner's reason and
cannot be launched.

Weights (next to context and streams) is part of the plan: auto (the most
precise precision at which the plan fits, from the checkpoint's own dtype
down: re-resolved on every edit) or f32 / bf16 / fp16 / int8 / int4; the
summary says which one the plan uses, and the memory bars are at it. The Plan
drawn here -- boundaries, per-stage peer and device, precision, context,
streams -- is the object Launch hands to the launcher, which checks it and
launches it as is (never re-plans). A fleet change re-plans only a plan the
user has not edited; an edited one is re-checked with the fresh figures.

Peers ("Run on"): N simulated local stages ("this PC ×N": real worker
processes on loopback through the local pipeline runner), or the fleet: every
agent the Fleet view sees. Fleet plans launch through the fleet launcher
(engine/fleet/launch.py, checked at runtime) once every peer in the plan is
paired and sharing; until then Launch is disabled with the reason.

Speculative decoding (engine/speculative): off, a draft model (demo-draft for
demo) or prompt lookup (no model), with K and adaptive K; it becomes the
engine's default, which a chat can still override per request.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QFormLayout, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QProgressBar,
    QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.fleet_model import FleetModel
from app.layer_bar import LayerBar, Segment
from app.memory_bar import MemoryBar
from app.session import OPENING, READY, EngineSession
from engine import client

LOCAL_KINDS = ("local", "moe", "sparse")


class PlanView(QWidget):
    plan_changed = Signal()  # self.plan or self.error changed (tests wait on it)

    def __init__(self, session: EngineSession, runner: Runner, fleet: FleetModel,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.runner, self.fleet = session, runner, fleet
        self._fleet_ids: tuple = ()  # the fleet peers the plan was made over
        self.spec = "demo"
        self.model = None  # PlanModel
        self.profile = None  # ModelProfile
        self.kinds: dict[str, client.EngineKind] = {}
        self.excluded: set[str] = set()
        self.plan = None  # client.Plan: what is drawn, and what Launch launches (this very object)
        self.error = ""  # why the plan cannot launch ("" = it can)
        self.note = ""  # a remark on how the plan was made
        self.checkpoint = "f32"  # the model's own weight dtype: where weights "auto" starts
        self.edited = False  # the user moved a boundary or pinned a device since the last auto-plan
        self._this_pc: client.PeerCard | None = None
        self._launch_rows: dict[int, tuple[QProgressBar, QLabel]] = {}
        self._build()
        session.changed.connect(self._sync_launch)
        session.launch_step.connect(self._on_launch_step)
        fleet.changed.connect(self._fleet_changed)
        self._sync_spec()
        self._load_kinds()
        self._load_models()
        self.set_model("demo")

    # -- layout ---------------------------------------------------------------------------
    def _build(self) -> None:
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        body = QWidget()
        scroll.setWidget(body)
        outer.addWidget(scroll)
        root = QVBoxLayout(body)
        root.setContentsMargins(24, 18, 24, 18)

        head = QHBoxLayout()
        head.addWidget(QLabel("Plan", objectName="title"))
        head.addStretch(1)
        self.model_box = QComboBox()
        self.model_box.setAccessibleName("Model")
        self.model_box.addItem("demo")
        self.model_box.activated.connect(lambda i: self.set_model(self.model_box.itemText(i)))
        self.engine_box = QComboBox()
        self.engine_box.setAccessibleName("Engine")
        self.engine_box.addItem("checking engines…", "pipeline")
        self.engine_box.currentIndexChanged.connect(self._on_kind_changed)
        self.stages_spin = QSpinBox(minimum=1, maximum=8, value=2, prefix="this PC ×")
        self.stages_spin.setAccessibleName("Simulated local stages")
        self.stages_spin.setToolTip("Simulated local stages: one worker process per stage on this PC "
                                    "(loopback), to plan and launch a pipeline without a fleet")
        self.stages_spin.valueChanged.connect(lambda _v: self._peers_changed())
        self.where_box = QComboBox()
        self.where_box.setAccessibleName("Run on")
        self.where_box.addItem("This PC", "local")
        self.where_box.addItem("Fleet peers", "fleet")
        self.where_box.setItemData(0, "Stage processes on this PC (loopback): no fleet needed",
                                   Qt.ItemDataRole.ToolTipRole)
        self.where_box.setItemData(1, "The agents the Fleet view found (pair them to launch)",
                                   Qt.ItemDataRole.ToolTipRole)
        self.where_box.currentIndexChanged.connect(lambda _i: self._where_changed())
        for text, w in (("Model", self.model_box), ("Engine", self.engine_box), ("Run on", self.where_box),
                        ("Peers", self.stages_spin)):
            label = QLabel(text, objectName="muted")
            head.addWidget(label)
            head.addWidget(w)
        self.stages_label = label
        root.addLayout(head)

        self.bar = LayerBar()
        self.bar.boundary_dragged.connect(self.move_boundary)
        root.addWidget(self.bar)
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        root.addWidget(self.summary)

        self.stage_box = QGroupBox("Peers in this plan")
        self.stage_grid = QGridLayout(self.stage_box)
        self.stage_grid.setHorizontalSpacing(12)
        root.addWidget(self.stage_box)

        row = QHBoxLayout()
        settings = QGroupBox("Engine settings")
        form = QFormLayout(settings)
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
        self.spec_mode.currentIndexChanged.connect(lambda _i: self._sync_spec())
        self.recover = QCheckBox("Recover a lost stage (warm standby process)")
        self.recover.setChecked(True)
        self.recover.setToolTip("When a stage process dies, a standby takes over and every answer "
                                "continues (engine/pipeline/recovery.py)")
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
        form.addRow("Cache budget", self.cache_budget)
        self.context.valueChanged.connect(lambda _v: self._request_changed())
        self.streams.valueChanged.connect(lambda _v: self._request_changed())
        self.weights_box.currentIndexChanged.connect(lambda _i: self._request_changed())
        self._spec_ok, self._spec_why = client.speculative_available()
        row.addWidget(settings, 1)

        launch = QGroupBox("Launch")
        ll = QVBoxLayout(launch)
        buttons = QHBoxLayout()
        self.auto_button = QPushButton("Auto-plan")
        self.auto_button.setToolTip("Let the planner split the layers (fastest bottleneck, fewest peers)")
        self.auto_button.clicked.connect(self.auto_plan)
        self.launch_button = QPushButton("Launch", objectName="primary")
        self.launch_button.clicked.connect(self.launch)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.session.cancel_launch)
        for b in (self.auto_button, self.launch_button, self.cancel_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        ll.addLayout(buttons)
        self.launch_reason = QLabel("", objectName="hint")
        self.launch_reason.setWordWrap(True)
        ll.addWidget(self.launch_reason)
        self.progress_grid = QGridLayout()
        ll.addLayout(self.progress_grid)
        ll.addStretch(1)
        row.addWidget(launch, 1)
        root.addLayout(row)
        root.addStretch(1)
        self.setTabOrder(self.model_box, self.engine_box)
        self.setTabOrder(self.engine_box, self.where_box)
        self.setTabOrder(self.where_box, self.stages_spin)
        self.setTabOrder(self.stages_spin, self.bar)

    # -- inputs ---------------------------------------------------------------------------
    def _load_kinds(self) -> None:
        task = self.runner.call(client.engine_kinds, name="kinds")
        task.result.connect(self._show_kinds)
        task.failed.connect(lambda exc: self.engine_box.setItemText(0, f"engines unavailable: {exc}"))

    def _show_kinds(self, kinds: list) -> None:
        self.kinds = {k.name: k for k in kinds}
        self.engine_box.blockSignals(True)
        self.engine_box.clear()
        for k in kinds:
            self.engine_box.addItem(k.label, k.name)
            i = self.engine_box.count() - 1
            tip = k.description if k.available else f"Not available: {k.reason}"
            self.engine_box.setItemData(i, tip, Qt.ItemDataRole.ToolTipRole)
            if not k.available:  # shown, disabled, with the reason: never a fake
                self.engine_box.model().item(i).setEnabled(False)
        self.engine_box.setCurrentIndex(max(0, self.engine_box.findData("pipeline")))
        self.engine_box.blockSignals(False)
        self._on_kind_changed()

    def _load_models(self) -> None:
        task = self.runner.call(client.list_models, name="plan-models")
        task.result.connect(self._show_models)

    def _show_models(self, entries: list) -> None:
        current = self.model_box.currentText()
        self.model_box.clear()
        for e in entries:
            if not e.error:
                self.model_box.addItem(e.model_id if e.kind in ("demo", "hub") else str(e.path))
        self.model_box.setCurrentText(current)

    @property
    def kind(self) -> str:
        return self.engine_box.currentData() or "pipeline"

    def set_model(self, spec: str) -> None:
        """Profile `spec` in the background, then auto-plan it."""
        self.spec = spec
        if self.model_box.findText(spec) < 0:
            self.model_box.addItem(spec)
        self.model_box.setCurrentText(spec)
        self.model = self.plan = None
        self.error, self.note = f"Reading {spec}…", ""
        self._redraw()

        def load():
            return client.plan_model(spec), (self._this_pc or client.this_pc()), client.draft_models(spec)

        task = self.runner.call(load, name="plan-model")
        task.result.connect(lambda res: self._on_model(spec, res))
        task.failed.connect(lambda exc: self._fail(f"Cannot read {spec}: {exc}"))

    def _on_model(self, spec: str, res: tuple) -> None:
        (model, profile), pc, drafts = res
        if spec != self.spec:
            return
        self.model, self.profile, self._this_pc = model, profile, pc
        self.checkpoint = model.checkpoint_precision
        self.draft_box.clear()
        self.draft_box.addItems(drafts)
        self.context.setValue(min(self.context.value(), profile.max_context or self.context.value()))
        self.auto_plan()

    @property
    def on_fleet(self) -> bool:
        return self.where_box.currentData() == "fleet"

    def fleet_cards(self) -> list:
        """The fleet peers the planner may use: every agent that answers."""
        return [c for c in self.fleet.peers() if c.reachable]

    def all_peers(self) -> list:
        if self.on_fleet:
            return client.fleet_peers(self.fleet_cards())
        return client.local_peers(self.stages_spin.value(), self._this_pc) if self._this_pc else []

    def peers(self) -> list:
        return [p for p in self.all_peers() if p.peer_id not in self.excluded]

    def speculative_choice(self) -> client.SpecChoice | None:
        mode = self.spec_mode.currentData()
        if mode == "off" or not self.spec_mode.isEnabled():
            return None
        return client.SpecChoice(mode, self.spec_k.value(), self.spec_adaptive.isChecked(),
                                 self.draft_box.currentText().strip() or None)

    def _spec_blocker(self) -> str:
        if not self._spec_ok:
            return self._spec_why
        if self.kind in ("moe", "sparse"):
            return f"the {self.kind} engine has no speculative decoding (local dense and pipeline do)"
        if self.kind == "pipeline" and self.on_fleet:
            return "not passed to the fleet launcher yet: use it on this PC's pipeline or the local engine"
        return ""

    def _sync_spec(self) -> None:
        why = self._spec_blocker()
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

    def _where_changed(self) -> None:
        self.excluded.clear()
        self.stages_spin.setVisible(not self.on_fleet)
        self.stages_label.setVisible(not self.on_fleet)
        self.recover.setEnabled(self.kind == "pipeline" and not self.on_fleet)
        self._sync_spec()
        self.auto_plan()

    def _fleet_changed(self) -> None:
        if not self.on_fleet or self.model is None:
            self._sync_launch()
            return
        ids = tuple(sorted(p.peer_id for p in self.all_peers()))
        if ids != self._fleet_ids and not (self.edited and self.plan is not None):
            self.auto_plan()  # peers came or went and the plan is the planner's own: plan again
        elif self.plan is not None:
            # Same peers, or the user's own plan: keep it and re-check it with the fresh figures
            # (RAM, pairing; a peer that left makes it invalid, with the reason).
            self._request_changed()
            if ids != self._fleet_ids:
                self._fleet_ids = ids
                self.note = "The fleet changed; your edited plan is kept (Auto-plan to use the new peers)."
                self._redraw()

    def weights_choice(self) -> str:
        """"auto" or a precision label (client.WEIGHT_CHOICES)."""
        return self.weights_box.currentData() or "auto"

    def request(self):
        return client.plan_request(self.context.value(), self.streams.value(), self.weights_choice())

    def _on_kind_changed(self) -> None:
        local = self.kind in LOCAL_KINDS
        self.stages_spin.setEnabled(not local)
        self.where_box.setEnabled(not local)
        self.bar.setEnabled(not local)
        self.weights_box.setEnabled(not local)
        self.weights_box.setToolTip(f"The {self.kind} engine runs the model's own weights" if local else
                                    "Weight precision of every shard: part of the plan (memory bars are at it)")
        self._sync_weights_hint()
        self.cache_budget.setEnabled(self.kind in ("moe", "sparse"))
        self.recover.setEnabled(self.kind == "pipeline" and not self.on_fleet)
        self._sync_spec()
        self._sync_launch()

    def _peers_changed(self) -> None:
        ids = {p.peer_id for p in self.all_peers()}
        self.excluded = {p for p in self.excluded if p in ids}
        self.auto_plan()

    def _request_changed(self) -> None:
        """Context or streams changed: re-evaluate the split on screen (do not re-plan,
        so the user sees what their change does to the plan they have)."""
        if self.plan is not None and self.model is not None:
            self._evaluate([(s.peer_id, s.device, s.start, s.end) for s in self.plan.stages])

    # -- planning ------------------------------------------------------------------------
    def auto_plan(self) -> None:
        if self.model is None:
            return
        self.edited = False
        model, peers, request, n = self.model, self.peers(), self.request(), len(self.peers())
        self._fleet_ids = tuple(sorted(p.peer_id for p in self.all_peers())) if self.on_fleet else ()
        if not peers:
            self.plan = None
            self._fail("no fleet peer answers yet: start `flotilla agent` on the PCs to lend, or add "
                       "one by address in the Fleet view" if self.on_fleet else "no peers")
            return
        if self.on_fleet:  # real peers: the planner's choice (fastest bottleneck, fewest peers) stands
            task = self.runner.call(lambda: (client.auto_plan(model, peers, request), ""), name="auto-plan")
            task.result.connect(lambda res: self._set_plan(res[0], res[1]))
            task.failed.connect(lambda exc: self._fail(str(exc)))
            return

        def plan():
            best = client.auto_plan(model, peers, request)
            if len(best.stages) >= n or n <= 1:
                return best, ""
            # Equal local stages: the planner's fewest-peers rule puts the model on one.
            kept = client.balanced_plan(model, peers, request)
            return kept, (f"The planner alone would use {len(best.stages)} of {n} stages "
                          f"({best.predicted_tok_s:.0f} tok/s predicted); the layers are balanced "
                          f"over all {n} so the pipeline runs as asked.")

        task = self.runner.call(plan, name="auto-plan")
        task.result.connect(lambda res: self._set_plan(res[0], res[1]))
        task.failed.connect(lambda exc: self._fail(str(exc)))

    def move_boundary(self, k: int, layer: int) -> None:
        if self.plan is None:
            return
        specs = [(s.peer_id, s.device, s.start, s.end) for s in self.plan.stages]
        a, b = specs[k], specs[k + 1]
        specs[k], specs[k + 1] = (a[0], a[1], a[2], layer), (b[0], b[1], layer, b[3])
        self.edited = True
        self._evaluate(specs, note="")

    def exclude(self, peer_id: str) -> None:
        self.excluded.add(peer_id)
        self.auto_plan()

    def include_all(self) -> None:
        self.excluded.clear()
        self.auto_plan()

    def pin(self, peer_id: str, device: str) -> None:
        if self.plan is None:
            return
        self.edited = True
        self._evaluate([(s.peer_id, device if s.peer_id == peer_id else s.device, s.start, s.end)
                        for s in self.plan.stages])

    def _evaluate(self, specs: list, note: str | None = None) -> None:
        """Predictions for an edited split (pure and fast: on the GUI thread)."""
        try:
            plan = client.evaluate_plan(specs, self.model, self.peers(), self.request())
        except client.PlanError as e:
            self._fail(str(e))
            return
        self._set_plan(plan, self.note if note is None else note)

    def _set_plan(self, plan, note: str) -> None:
        self.plan, self.note = plan, note
        self.error = "" if plan.fits else self._memory_reason(plan)
        self._redraw()

    def _memory_reason(self, plan) -> str:
        issues = client.validate_plan(plan, self.model, self.peers(), self.request())
        reason = "; ".join(i.message for i in issues) or "a stage does not fit its peer's memory"
        if self.weights_choice() == "auto" and client.plan_precision(plan) != self.checkpoint:
            reason = f"even with {client.plan_precision(plan)} weights, {reason}"
        return reason

    def _fail(self, reason: str) -> None:
        self.error = reason
        if self.plan is not None and self.model is not None:
            # Keep drawing the last plan, outlined red, with the reason below.
            pass
        self._redraw()

    # -- drawing ----------------------------------------------------------------------------
    def _peer_name(self, peer_id: str) -> str:
        if self.on_fleet:
            return next((c.name for c in self.fleet.peers() if c.peer_id == peer_id), peer_id[:8])
        return next((p.name for p in client.local_peers(self.stages_spin.value(), self._this_pc)
                     if p.peer_id == peer_id), peer_id) if self._this_pc else peer_id

    def _redraw(self) -> None:
        plan = self.plan
        if plan is None or self.model is None:
            self.bar.set_plan(0, [])
        else:
            segs = [Segment(s.start, s.end, f"{self._peer_name(s.peer_id)} · {s.device}", s.fits)
                    for s in plan.stages]
            self.bar.set_plan(self.model.num_layers, segs, invalid=bool(self.error))
        if self.error:
            self.summary.setStyleSheet(f"color: {style.ERROR};")
            self.summary.setText(f"<b>This plan cannot launch.</b> {self.error}")
        elif plan is not None:
            self.summary.setStyleSheet("")
            self.summary.setText(
                f"<b>{plan.predicted_tok_s:.0f} tok/s</b> predicted for one stream, "
                f"<b>{plan.predicted_aggregate_tok_s:.0f} tok/s</b> with {plan.streams} streams · "
                f"bottleneck {plan.bottleneck_ms:.2f} ms/token · {len(plan.stages)} stage(s) over "
                f"{self.model.num_layers} layers<br>{self.weights_text()}"
                + (f"<br><i>{self.note}</i>" if self.note else ""))
        else:
            self.summary.setStyleSheet("")
            self.summary.setText("")
        self._fill_stages()
        self._sync_weights_hint()
        self._sync_launch()
        self.plan_changed.emit()

    def _sync_weights_hint(self) -> None:
        auto = self.plan is not None and self.weights_choice() == "auto" and self.kind not in LOCAL_KINDS
        self.weights_used.setText(f"→ {client.plan_precision(self.plan)} for this plan" if auto else "")

    def weights_text(self) -> str:
        """What the summary says about the plan's weights: the precision it will run at, and why."""
        if self.plan is None:
            return ""
        used = client.plan_precision(self.plan)
        if self.kind in LOCAL_KINDS:
            return f"Weights: the model's own ({self.checkpoint}) on the {self.kind} engine"
        if self.weights_choice() == "auto":
            why = ("the model's own precision" if used == self.checkpoint else
                   f"the most precise at which this plan fits; the model's own {self.checkpoint} does not")
            return f"Weights <b>{used}</b> (auto: {why}) · context {self.plan.context_length} tokens"
        return f"Weights <b>{used}</b> (chosen) · context {self.plan.context_length} tokens"

    def _fill_stages(self) -> None:
        while self.stage_grid.count():
            w = self.stage_grid.takeAt(0).widget()
            if w is not None:
                w.setParent(None)
                w.deleteLater()
        weights = f"{client.plan_precision(self.plan)} weights" if self.plan is not None else "weights"
        for col, text in enumerate(["Peer", "Device", "Layers", f"Memory ({weights} + KV + reserves)",
                                    "Predicted", ""]):
            self.stage_grid.addWidget(QLabel(text, objectName="muted"), 0, col)
        if self.plan is None:
            return
        peers = {p.peer_id: p for p in self.peers()}
        for i, s in enumerate(self.plan.stages):
            r = i + 1
            swatch = QLabel(f"■ {self._peer_name(s.peer_id)}")
            swatch.setStyleSheet(f"color: {style.stage_colour(i)}; font-weight: 600;")
            device = QComboBox()
            device.setAccessibleName(f"Device of {self._peer_name(s.peer_id)}")
            for d in (peers[s.peer_id].devices if s.peer_id in peers else ()):
                device.addItem(d.name)
            device.setCurrentText(s.device)
            device.activated.connect(lambda _i, pid=s.peer_id, box=device: self.pin(pid, box.currentText()))
            mem = MemoryBar()
            mem.set_values(s.resident_weight_bytes, s.kv_bytes, s.margin_bytes, s.ram_free_bytes, style.stage_colour(i))
            excl = QPushButton("Exclude")
            excl.setToolTip("Re-plan without this peer")
            excl.setEnabled(len(self.plan.stages) > 1 or len(peers) > 1)
            excl.clicked.connect(lambda _=False, pid=s.peer_id: self.exclude(pid))
            for col, w in enumerate([swatch, device, QLabel(f"{s.start}–{s.end} ({s.num_layers})"), mem,
                                     QLabel(f"{s.predicted_tok_s:.0f} tok/s"), excl]):
                self.stage_grid.addWidget(w, r, col)
        if self.excluded:
            names = ", ".join(sorted(self._peer_name(p) for p in self.excluded))
            back = QPushButton(f"Include {names} again")
            back.clicked.connect(self.include_all)
            self.stage_grid.addWidget(back, len(self.plan.stages) + 1, 0, 1, 3)

    # -- launching -----------------------------------------------------------------------------
    def launch_blocker(self) -> str:
        """Why Launch is disabled ("" = it is enabled)."""
        kind = self.kinds.get(self.kind)
        if kind is None:
            return "checking which engines are available…"
        if not kind.available:
            return f"{kind.label} is not available: {kind.reason}"
        if self.session.state == OPENING:
            return "a launch is in progress (Cancel stops it)"
        if self.model is None:
            return self.error or "no model yet"
        if self.kind == "moe" and self.profile is not None and self.profile.experts is None:
            return f"{self.spec} is dense: MoE offload needs a model with experts (try demo-moe)"
        if self.kind in LOCAL_KINDS:
            return ""
        if self.plan is None or self.error:
            return f"the plan is invalid: {self.error}" if self.error else "no plan yet"
        if self.on_fleet:
            return self._fleet_blocker()
        if len({s.device for s in self.plan.stages}) > 1:
            return "the local runner runs every stage on one device: pick the same device for all"
        return ""

    def _fleet_blocker(self) -> str:
        if not self.fleet.launch_ok:
            return self.fleet.launch_reason
        cards = {c.peer_id: c for c in self.fleet.peers()}
        gone = [s.peer_id for s in self.plan.stages if s.peer_id not in cards]
        if gone:
            return f"{len(gone)} peer(s) of this plan left the fleet: plan again"
        unpaired = [cards[s.peer_id].name for s in self.plan.stages if not cards[s.peer_id].paired]
        if unpaired:
            return (f"pair {', '.join(dict.fromkeys(unpaired))} first (Fleet view → Pair…): "
                    "an agent obeys paired controllers only")
        busy = [f"{cards[s.peer_id].name} ({cards[s.peer_id].sharing})" for s in self.plan.stages
                if cards[s.peer_id].sharing_now is False]
        if busy:
            return f"not sharing right now: {', '.join(dict.fromkeys(busy))}"
        return ""

    def _sync_launch(self) -> None:
        why = self.launch_blocker()
        self.launch_button.setEnabled(not why)
        self.launch_button.setToolTip(why or "Start the engine with this plan")
        self.auto_button.setEnabled(self.model is not None and self.kind not in LOCAL_KINDS)
        self.cancel_button.setEnabled(self.session.state == OPENING)
        if why:
            self.launch_reason.setText(f"Launch is disabled: {why}")
        elif self.session.state == READY and self.session.engine is not None:
            self.launch_reason.setText(f"Running: {self.session.label()}"
                                       + (f" ({self.session.plan_text})" if self.session.plan_text else ""))
        elif self.session.state == "failed":
            self.launch_reason.setText(f"Last launch failed: {self.session.error}")
            for i, (bar, label) in self._launch_rows.items():
                if i in self.session.refused:  # its agent said no: say why on its own row
                    label.setText(f"refused: {self.session.refused[i]}")
                    bar.setValue(0)
                elif label.text() != "ready":
                    label.setText("stopped")
                    bar.setValue(0)
        else:
            self.launch_reason.setText("")

    def launch(self) -> None:
        if self.launch_blocker():
            return
        self._clear_progress()
        if self.kind in LOCAL_KINDS:
            budget = self.cache_budget.value() * 1_000_000 or None
            settings = {"context_length": self.context.value(), "streams": self.streams.value(),
                        "speculative": self.speculative_choice()} \
                if self.kind == "local" else {"cache_budget_bytes": budget}
            self.session.open(self.spec, self.kind, **settings)
            return
        plan = self.plan  # this very object is launched: what is drawn is what runs
        for i, s in enumerate(plan.stages):
            bar = QProgressBar()
            bar.setRange(0, 100)
            bar.setTextVisible(False)
            label = QLabel("waiting", objectName="muted")
            label.setWordWrap(True)  # a refusal's why with its numbers can be long
            self.progress_grid.addWidget(QLabel(f"{self._peer_name(s.peer_id)} ({s.start}–{s.end})"), i, 0)
            self.progress_grid.addWidget(bar, i, 1)
            self.progress_grid.addWidget(label, i, 2)
            self._launch_rows[i] = (bar, label)
        if self.on_fleet:
            self.session.launch_fleet(self.spec, plan, self.fleet.peers())
            return
        self.session.launch_pipeline(self.spec, plan, speculative=self.speculative_choice(),
                                     recover=self.recover.isChecked())

    def _clear_progress(self) -> None:
        while self.progress_grid.count():
            w = self.progress_grid.takeAt(0).widget()
            if w is not None:
                w.setParent(None)
                w.deleteLater()
        self._launch_rows = {}

    def _on_launch_step(self, step: client.LaunchStep) -> None:
        row = self._launch_rows.get(step.stage)
        if row is None:
            return
        bar, label = row
        bar.setValue({"waiting": 0, "transfer": 35, "compile": 70, "ready": 100}.get(step.phase, 0))
        label.setText(f"{step.phase}: {step.message}" if step.phase not in ("waiting", "ready")
                      else step.phase)

    def launch_phases(self) -> list[str]:
        """The phase text of every stage row (tests)."""
        return [label.text() for _bar, label in self._launch_rows.values()]

    def restyle(self) -> None:
        self._redraw()
