"""A model folder the launcher's flags can be checked against: a config, no weights (nothing is loaded)."""

import json

import pytest


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return tmp_path
