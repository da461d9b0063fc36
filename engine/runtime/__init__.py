"""Single-machine generation: sampling, detokenizing, chat templates, the
generation loop and the model backends (OpenVINO, torch reference)."""
