"""The plan editor: pick a model, an engine and peers; see and edit how the
layers are split; launch.

The planner (engine/planner/plan.py, through engine.client) is pure and
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
    QComboBox, QGroupBox, QHBoxLayout, QLabel, QPushButton, QSpinBox, QVBoxLayout, QWidget,
)

from app import style
from app.plan import rules as plan_rules
from app.background import Runner
from app.fleet.model import FleetModel
from app.plan.launch_progress import LaunchProgress
from app.plan.layer_bar import LayerBar, Segment
from app.plan.rules import LOCAL_KINDS
from app.plan.settings_box import EngineSettings
from app.plan.stage_table import StageTable
from app.session import OPENING, READY, EngineSession
from engine import client


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
        self._build()
        session.changed.connect(self._sync_launch)
        session.launch_step.connect(self.progress.show_step)
        fleet.changed.connect(self._fleet_changed)
        self._sync_spec()
        self._load_kinds()
        self._load_models()
        self.set_model("demo")

    # -- layout ---------------------------------------------------------------------------
    def _build(self) -> None:
        root = style.scrolling_page(self)

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

        self.stage_box = StageTable()
        self.stage_box.pin_requested.connect(self.pin)
        self.stage_box.exclude_requested.connect(self.exclude)
        self.stage_box.include_all_requested.connect(self.include_all)
        root.addWidget(self.stage_box)

        row = QHBoxLayout()
        self.settings = EngineSettings()
        self.settings.spec_mode.currentIndexChanged.connect(lambda _i: self._sync_spec())
        self.settings.context.valueChanged.connect(lambda _v: self._request_changed())
        self.settings.streams.valueChanged.connect(lambda _v: self._request_changed())
        self.settings.weights_box.currentIndexChanged.connect(lambda _i: self._request_changed())
        self.settings.exact_cache.toggled.connect(lambda _on: self._request_changed())
        self._spec_ok, self._spec_why = client.speculative_available()
        row.addWidget(self.settings, 1)

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
        self.progress = LaunchProgress()
        ll.addLayout(self.progress)
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
        self.settings.draft_box.clear()
        self.settings.draft_box.addItems(drafts)
        context = self.settings.context
        context.setValue(min(context.value(), profile.max_context or context.value()))
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

    def _sync_spec(self) -> None:
        self.settings.show_spec(plan_rules.spec_blocker(self._spec_ok, self._spec_why, self.kind, self.on_fleet))

    def _where_changed(self) -> None:
        self.excluded.clear()
        self.stages_spin.setVisible(not self.on_fleet)
        self.stages_label.setVisible(not self.on_fleet)
        self.settings.recover.setEnabled(self.kind == "pipeline" and not self.on_fleet)
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

    def request(self):
        settings = self.settings
        return client.plan_request(settings.context.value(), settings.streams.value(), settings.weights_choice(),
                                   exact_prompt_cache=self.exact_cache())

    def exact_cache(self) -> bool:
        """The exact prompt cache, asked for and offered (pipelines only)."""
        box = self.settings.exact_cache
        return box.isEnabled() and box.isChecked()

    def _on_kind_changed(self) -> None:
        local = self.kind in LOCAL_KINDS
        self.stages_spin.setEnabled(not local)
        self.where_box.setEnabled(not local)
        self.bar.setEnabled(not local)
        weights = self.settings.weights_box
        weights.setEnabled(not local)
        weights.setToolTip(f"The {self.kind} engine runs the model's own weights" if local else
                           "Weight precision of every shard: part of the plan (memory bars are at it)")
        self._sync_weights_hint()
        self.settings.cache_budget.setEnabled(self.kind in ("moe", "sparse"))
        self.settings.recover.setEnabled(self.kind == "pipeline" and not self.on_fleet)
        self.settings.exact_cache.setEnabled(self.kind == "pipeline")
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

        task = self.runner.call(lambda: plan_rules.local_stages_plan(model, peers, request, n), name="auto-plan")
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
        self.error = "" if plan.fits else plan_rules.memory_reason(
            plan, self.model, self.peers(), self.request(), self.settings.weights_choice(), self.checkpoint)
        self._redraw()

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
            weights = plan_rules.weights_text(plan, self.kind, self.checkpoint, self.settings.weights_choice())
            self.summary.setText(
                f"<b>{plan.predicted_tok_s:.0f} tok/s</b> predicted for one stream, "
                f"<b>{plan.predicted_aggregate_tok_s:.0f} tok/s</b> with {plan.streams} streams · "
                f"bottleneck {plan.bottleneck_ms:.2f} ms/token · {len(plan.stages)} stage(s) over "
                f"{self.model.num_layers} layers<br>{weights}"
                + (f"<br><i>{self.note}</i>" if self.note else ""))
        else:
            self.summary.setStyleSheet("")
            self.summary.setText("")
        self.stage_box.fill(plan, self.peers(), self.excluded, self._peer_name)
        self._sync_weights_hint()
        self._sync_launch()
        self.plan_changed.emit()

    def _sync_weights_hint(self) -> None:
        auto = self.plan is not None and self.settings.weights_choice() == "auto" and self.kind not in LOCAL_KINDS
        self.settings.weights_used.setText(f"→ {client.plan_precision(self.plan)} for this plan" if auto else "")

    # -- launching -----------------------------------------------------------------------------
    def launch_blocker(self) -> str:
        """Why Launch is disabled ("" = it is enabled)."""
        return plan_rules.launch_blocker(self.kind, self.kinds.get(self.kind), self.session.state == OPENING,
                                         self.spec, self.model, self.profile, self.plan, self.error,
                                         self.fleet if self.on_fleet else None)

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
            self.progress.show_failed(self.session.refused)
        else:
            self.launch_reason.setText("")

    def launch(self) -> None:
        if self.launch_blocker():
            return
        self.progress.clear_rows()
        if self.kind in LOCAL_KINDS:
            budget = self.settings.cache_budget.value() * 1_000_000 or None
            settings = {"context_length": self.settings.context.value(), "streams": self.settings.streams.value(),
                        "speculative": self.settings.speculative_choice()} \
                if self.kind == "local" else {"cache_budget_bytes": budget}
            self.session.open(self.spec, self.kind, **settings)
            return
        plan = self.plan  # this very object is launched: what is drawn is what runs
        for i, s in enumerate(plan.stages):
            self.progress.add_stage(i, f"{self._peer_name(s.peer_id)} ({s.start}–{s.end})")
        if self.on_fleet:
            self.session.launch_fleet(self.spec, plan, self.fleet.peers(), exact_cache=self.exact_cache())
            return
        self.session.launch_pipeline(self.spec, plan, speculative=self.settings.speculative_choice(),
                                     recover=self.settings.recover.isChecked(), exact_cache=self.exact_cache())

    def restyle(self) -> None:
        self._redraw()
