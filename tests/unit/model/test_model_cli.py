"""`crucible model info|import|export` on a tiny checkpoint built locally, with a tokenizer of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from cli_runner import crucible
from tokenizers import Tokenizer, models, pre_tokenizers

SIZES = dict(
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=128, head_dim=32, initializer_range=0.2,
)  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES)).eval()
    path = tmp_path / "qwen3"
    model.save_pretrained(path)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 64)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path, model


def test_info_import_export_round_trip(checkpoint, tmp_path: Path) -> None:
    source, reference = checkpoint
    info = crucible("model", "info", str(source), "--json")
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout)
    assert summary["family"] == "qwen3" and summary["head_dim"] == 32
    assert summary["parameters"] == sum(p.numel() for p in reference.parameters())

    done = crucible("model", "import", str(source), "--out", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr
    assert {"manifest.msgpack", "model_config.json", "shard-0.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "ckpt").iterdir()
    }
    again = crucible("model", "import", str(source), "--out", str(tmp_path / "ckpt"))
    assert again.returncode == 2 and "already exists" in again.stderr

    done = crucible("model", "export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(x).logits - reference(x).logits).abs().max() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("w3 w5")["input_ids"] == [3, 5]


def test_a_corrupt_checkpoint_shard_is_refused(checkpoint, tmp_path: Path) -> None:
    source, _ = checkpoint
    assert crucible("model", "import", str(source), "--out", str(tmp_path / "ckpt")).returncode == 0
    shard = tmp_path / "ckpt" / "shard-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = crucible("model", "export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert done.returncode == 2 and "sha256 differs" in done.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "--out", "x"], "exactly one of --checkpoint and --run"),
        (["import", "tiny", "--out", "x"], "a preset has no pretrained weights"),
        (["info", "package:nope"], "unknown packaged model 'nope'"),
    ],
)
def test_bad_usage_is_a_clear_error(args: list[str], message: str) -> None:
    done = crucible("model", *args)
    assert done.returncode == 2 and message in done.stderr
