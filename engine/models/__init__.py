"""Model sources (demo, HF folder, OpenVINO IR, hub), inspection and catalog.

Importing this package is cheap: torch and transformers load only when a demo
is built or an unusual config needs transformers' causal-LM mapping.
"""

from engine.models.catalog import (LocalModelEntry, add_model_folder, config_dir,
                                   list_local_models, remove_model_folder)
from engine.models.demo import demo_ids, ensure_demo, is_demo_id
from engine.models.errors import ModelError
from engine.models.profile import ExpertInfo, ModelProfile, profile_model
from engine.models.ref import ResolvedModel, hf_cache_dir, read_safetensors_header, resolve_model

__all__ = [
    "ExpertInfo", "LocalModelEntry", "ModelError", "ModelProfile", "ResolvedModel",
    "add_model_folder", "config_dir", "demo_ids", "ensure_demo", "hf_cache_dir", "is_demo_id",
    "list_local_models", "profile_model", "read_safetensors_header", "remove_model_folder",
    "resolve_model",
]
