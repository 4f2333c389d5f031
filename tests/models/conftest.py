"""Shared fixtures for the model tests: the packaged all-MiniLM-L6-v2 loaded once per session,
by qkv and by the two independent references (sentence-transformers, transformers).

The references are test-only dependencies and run offline: HF_HUB_OFFLINE is set before they
are imported, and every model is loaded from the package's local directory.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network, whatever the references try
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import qkv_minilm

from qkv.models import Encoder, load_encoder


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return qkv_minilm.MODEL_DIR


@pytest.fixture(scope="session")
def encoder() -> Encoder:
    return load_encoder()


@pytest.fixture(scope="session")
def st_model(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """transformers' BertModel with the explicit (eager) attention, which returns probabilities."""
    from transformers import BertModel

    return BertModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
