"""Start-up from the meta device (`shard_load.py`), in one process: a model built on meta and filled from its
files equals the one transformers loads, including the buffers the files do not hold; every way the files can
disagree with the config is a one-line ModelError. The sharded path (rows per rank) is
tests/integration/test_sharded.py."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from echo2cli.errors import ModelError
from echo2cli.learner.shard_load import is_meta, materialize, meta_model


def save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    return save(LlamaForCausalLM(cfg), tmp_path / "llama")


def qwen3_dir(tmp_path, **kwargs):
    torch.manual_seed(1)
    cfg = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return save(Qwen3ForCausalLM(cfg), tmp_path / "qwen3", **kwargs)


def built(path):
    model = meta_model(path, torch.float32)
    assert is_meta(model)
    materialize(model, model, path, torch.device("cpu"))
    assert not is_meta(model)
    return model


def assert_same_model(path):
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11]])
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = built(path)
    for (name, a), (_, b) in zip(whole.state_dict().items(), ours.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=0)


def test_llama_with_tied_embeddings_built_on_meta_equals_the_loaded_one(llama_dir):
    assert_same_model(llama_dir)
    model = built(llama_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_qwen3_from_a_sharded_checkpoint_built_on_meta_equals_the_loaded_one(tmp_path):
    path = qwen3_dir(tmp_path, max_shard_size="8KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    assert_same_model(path)


def test_a_tensor_missing_from_the_files_is_a_one_line_error(llama_dir):
    weights = load_file(str(llama_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(llama_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="1 tensors missing, e.g. model.layers.1.mlp.up_proj.weight"):
        built(llama_dir)


def test_a_tensor_of_another_shape_is_a_one_line_error(llama_dir):
    weights = load_file(str(llama_dir / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(31)
    save_file(weights, str(llama_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model.norm.weight is \[31\] in the file, \[32\] here"):
        built(llama_dir)


def test_no_weights_and_no_config_are_one_line_errors(llama_dir, tmp_path):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors weights"):
        built(llama_dir)
    with pytest.raises(ModelError, match="does not load"):
        meta_model(tmp_path / "nothing-here", torch.float32)


def test_a_buffer_the_initializer_leaves_unset_is_an_error_not_garbage(llama_dir, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "_init_weights", lambda self, module: None)
    with pytest.raises(ModelError, match="inv_freq is not set by transformers' initializer"):
        built(llama_dir)
