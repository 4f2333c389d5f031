"""The directory of all-MiniLM-L6-v2 (config.json, tokenizer.json, model.safetensors and the
tokenizer and pooling configs), unchanged from its publication.

The files lie next to this module; ``MODEL_DIR`` is their directory. Importing this module
imports nothing else, and qkv does not even import it: it finds the directory with
``importlib.util.find_spec("qkv_minilm")``. Origin, license and checksums: NOTICE.
"""

from pathlib import Path

__version__ = "1.0.0"

MODEL_DIR = Path(__file__).resolve().parent
