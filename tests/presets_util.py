"""Loading the configs/ presets from tests, wherever pytest runs from."""

import pathlib

from glmjax import presets

REPO = pathlib.Path(__file__).resolve().parent.parent


def load_model_config(relative_path: str, *overrides: str):
    return presets.model_config_from(presets.load_config(str(REPO / relative_path), overrides))
