"""The safetensors loader on small crafted checkpoints.

A tiny random BERT written by transformers' own ``save_pretrained`` is the valid starting
point (its key names come from the independent implementation); each test then damages one
thing and checks that the error names the key and that nothing was copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.models import BertConfig, BertEncoder, load_bert_weights, load_encoder, read_header

TINY = {
    "vocab_size": 30522,  # the real tokenizer.json is reused, so its vocabulary must fit
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "max_position_embeddings": 64,
}
QUERY = "encoder.layer.0.attention.self.query.weight"


def _save_tiny(cls_name: str, directory: Path, model_dir: Path) -> torch.nn.Module:
    import transformers

    torch.manual_seed(1)
    config = transformers.BertConfig(**TINY)
    model = getattr(transformers, cls_name)(config).eval()
    model.save_pretrained(str(directory))
    shutil.copy(model_dir / "tokenizer.json", directory / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny-bert")
    return directory, _save_tiny("BertModel", directory, model_dir)


@pytest.fixture
def tiny_tensors(tiny_dir: tuple[Path, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_dir[0] / "model.safetensors"))


@pytest.fixture
def config() -> BertConfig:
    return BertConfig(**TINY)


def _hidden_states_match(directory: Path, reference: torch.nn.Module) -> None:
    encoder = load_encoder(directory)
    text = "The trophy did not fit into the suitcase."
    inspection = encoder.inspect(text)
    ids = torch.tensor([encoder.tokenizer.encode(text).ids])
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states  # layers + 1 of (1, T, D)
    torch.testing.assert_close(inspection.hidden_states, torch.stack(hidden)[:, 0], atol=1e-5, rtol=1e-5)


def test_tiny_transformers_checkpoint_loads_and_matches(tiny_dir: tuple[Path, torch.nn.Module]) -> None:
    directory, reference = tiny_dir
    _hidden_states_match(directory, reference)


def test_pretraining_checkpoint_nested_under_bert_prefix(tmp_path: Path, model_dir: Path) -> None:
    reference = _save_tiny("BertForMaskedLM", tmp_path, model_dir)
    names = read_header(tmp_path / "model.safetensors")
    assert any(n.startswith("bert.") for n in names) and any(n.startswith("cls.") for n in names)
    _hidden_states_match(tmp_path, reference)


def _load_error(tmp_path: Path, tensors: dict[str, torch.Tensor], config: BertConfig) -> str:
    """Save ``tensors``, load them, and return the error message; checks nothing was copied."""
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    module = BertEncoder(config)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit the BERT config") as error:
        load_bert_weights(module, path, config)
    assert _untouched(module, before)
    return str(error.value)


def _untouched(module: BertEncoder, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_wrong_shape(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig) -> None:
    tiny_tensors[QUERY] = torch.zeros(8, 4)
    message = _load_error(tmp_path, tiny_tensors, config)
    assert f"{QUERY}: shape [8, 4], expected [8, 8]" in message


def test_missing_keys_are_all_reported(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig) -> None:
    gone = ["encoder.layer.1.output.LayerNorm.bias", "embeddings.token_type_embeddings.weight"]
    for key in gone:
        del tiny_tensors[key]
    message = _load_error(tmp_path, tiny_tensors, config)
    assert "missing keys (2)" in message
    assert all(key in message for key in gone)


def test_extra_key(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig) -> None:
    tiny_tensors["encoder.layer.0.attention.self.distance_embedding.weight"] = torch.zeros(3, 2)
    message = _load_error(tmp_path, tiny_tensors, config)
    assert "unexpected keys (1): encoder.layer.0.attention.self.distance_embedding.weight" in message


def test_every_problem_in_one_error(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig) -> None:
    del tiny_tensors["encoder.layer.1.output.dense.weight"]
    tiny_tensors["surprise"] = torch.zeros(1)
    tiny_tensors[QUERY] = torch.zeros(2, 2)
    tiny_tensors["embeddings.LayerNorm.bias"] = torch.zeros(8, dtype=torch.int32)
    message = _load_error(tmp_path, tiny_tensors, config)
    for fragment in ("encoder.layer.1.output.dense.weight", "surprise", f"{QUERY}: shape [2, 2]",
                     "embeddings.LayerNorm.bias: dtype I32"):
        assert fragment in message, fragment


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64])
def test_wrong_dtype(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig, dtype: torch.dtype) -> None:
    tiny_tensors[QUERY] = tiny_tensors[QUERY].to(dtype)
    message = _load_error(tmp_path, tiny_tensors, config)
    assert f"{QUERY}: dtype" in message and "expected one of F32, F16, BF16" in message


def test_half_precision_checkpoint_is_upcast(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig) -> None:
    path = tmp_path / "model.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tiny_tensors.items()}, str(path))
    module = BertEncoder(config)
    load_bert_weights(module, path, config)
    loaded = module.layers[0].attention.q_proj.weight
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, tiny_tensors[QUERY].half().float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], config: BertConfig, bad: float) -> None:
    tiny_tensors[QUERY][3, 1] = bad
    tiny_tensors["encoder.layer.1.output.LayerNorm.weight"][0] = bad
    path = tmp_path / "model.safetensors"
    save_file(tiny_tensors, str(path))
    module = BertEncoder(config)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="NaN or infinite") as error:
        load_bert_weights(module, path, config)
    assert QUERY in str(error.value) and "encoder.layer.1.output.LayerNorm.weight" in str(error.value)
    assert _untouched(module, before)  # nothing is copied from a refused file


def test_truncated_file_names_the_cut_tensor(tmp_path: Path, tiny_dir: tuple[Path, torch.nn.Module], config: BertConfig) -> None:
    raw = (tiny_dir[0] / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw[:-10])
    module = BertEncoder(config)
    with pytest.raises(ValueError, match=rf"truncated: tensor '{last}'"):
        load_bert_weights(module, path, config)


def test_file_cut_inside_its_header(tmp_path: Path, tiny_dir: tuple[Path, torch.nn.Module]) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((tiny_dir[0] / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="not a complete safetensors file"):
        read_header(path)


@pytest.mark.parametrize("content", [b"", b"abc", b"\x05\x00\x00\x00\x00\x00\x00\x00nojso"])
def test_not_a_safetensors_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"not a safetensors file|not a complete safetensors file"):
        read_header(path)


def test_pickle_renamed_to_safetensors_is_not_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.save({"x": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match="safetensors"):
        read_header(path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.ckpt"])
def test_pickle_suffixes_are_refused(tmp_path: Path, config: BertConfig, name: str) -> None:
    path = tmp_path / name
    torch.save({"x": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match="pickle checkpoint; qkv loads only safetensors"):
        load_bert_weights(BertEncoder(config), path, config)


def test_config_mismatch_is_reported_per_key(tmp_path: Path, tiny_dir: tuple[Path, torch.nn.Module]) -> None:
    # A config with one layer too many for the file, and a wider feed-forward layer
    config = BertConfig(**{**TINY, "num_hidden_layers": 3, "intermediate_size": 32})
    with pytest.raises(ValueError, match="does not fit the BERT config") as error:
        load_bert_weights(BertEncoder(config), tiny_dir[0] / "model.safetensors", config)
    message = str(error.value)
    assert "num_hidden_layers=3 asks for layers 2..2, which the file does not hold (it has 2)" in message
    assert "encoder.layer.1.intermediate.dense.weight: shape [16, 8], expected [32, 8] from the config" in message


def _rewrite_header(source: Path, target: Path, edit) -> None:
    """Copy a safetensors file with its JSON header changed by ``edit(header)``."""
    raw = source.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    edit(header)
    encoded = json.dumps(header).encode()
    target.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + header_len :])


def _first_two(header: dict) -> tuple[str, str]:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def _overlap(header: dict) -> None:
    # the second tensor starts 4 bytes inside the first (its size still agrees with its shape)
    _, second = _first_two(header)
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]


def _hole(header: dict) -> None:
    first, _ = _first_two(header)
    header[first]["data_offsets"][0] += 4
    header[first]["data_offsets"][1] += 4


def _same_bytes(header: dict) -> None:
    # two tensors of one shape pointed at the same bytes: each would read the other's values
    names = [k for k in header if k.endswith("LayerNorm.bias")]
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_same_bytes, "overlap"),
        (_overlap, "overlap"),
        (_hole, "belong to no tensor|cover"),
        (lambda h: h[QUERY].update(data_offsets=[-4, 252]), "malformed shape .* or data offsets"),
        (lambda h: h[QUERY].update(data_offsets=[0.0, 256.0]), "malformed shape .* or data offsets"),
        (lambda h: h[QUERY].update(shape=[8, -8]), "malformed shape"),
        (lambda h: h[QUERY].update(shape=[8, True]), "malformed shape"),
    ],
)
def test_corrupt_offsets_are_refused_before_reading(
    tmp_path: Path, tiny_dir: tuple[Path, torch.nn.Module], config: BertConfig, edit, message: str
) -> None:
    path = tmp_path / "model.safetensors"
    _rewrite_header(tiny_dir[0] / "model.safetensors", path, edit)
    with pytest.raises(ValueError, match=message):
        read_header(path)
    with pytest.raises(ValueError, match=message):
        load_bert_weights(BertEncoder(config), path, config)


def test_huge_config_is_refused_before_anything_is_allocated(
    tmp_path: Path, tiny_dir: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qkv.models.encoder as encoder_module

    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(tiny_dir[0] / name, tmp_path / name)
    raw = json.loads((tiny_dir[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1_000_000, "intermediate_size": 10**9}))

    def no_model(config: BertConfig) -> None:
        raise AssertionError("a model was built before the file was checked against the config")

    monkeypatch.setattr(encoder_module, "BertEncoder", no_model)
    with pytest.raises(ValueError, match="does not fit the BERT config") as error:
        load_encoder(tmp_path)
    message = str(error.value)
    assert "num_hidden_layers=1000000 asks for layers 2..999999, which the file does not hold (it has 2)" in message
    assert "expected [1000000000, 8] from the config" in message
    assert len(message) < 10_000  # a summary, not a list of sixteen million keys
