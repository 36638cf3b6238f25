"""The safetensors export loads in Hugging Face ``transformers`` as the model it was saved from (G17).

A tiny random Llama is saved the way a training job saves it (``{"model": model.state_dict()}`` through the
manager, so every stored key carries a ``model.`` prefix), exported with ``--strip-prefix`` (and ``--tie`` when
the embeddings are tied), and loaded by ``AutoModelForCausalLM.from_pretrained``: no missing, unexpected or
mismatched key, and logits bit-exact.  (The documented example in docs/cli.md, its export and its load by
``from_pretrained``, runs as written in ``tests/guards/test_docs_site.py``.)  Names that cannot come out as asked are
refused by name, before a byte is written, and an existing export is replaced only with ``--force``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcp_atomic import CheckpointManager
from dcp_atomic.tools.cli import main
from tests.helpers.markdown_blocks import REPO

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' (transformers is a test extra)")
from safetensors import safe_open  # noqa: E402 - after the skip: both come with the test extra
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow

RUN, STEP = "llama", 20


def _llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def _save(root: str, model: torch.nn.Module) -> None:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(8).unsqueeze(0)).logits.sum().backward()
    optimizer.step()  # tensors in the optimizer state: left out of the export with --keys
    with CheckpointManager(root, RUN, timeout=60) as manager:
        manager.save(STEP, {"model": model.state_dict(), "optim": optimizer.state_dict()})


def _exported_keys(out: str) -> set[str]:
    keys: set[str] = set()
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                keys.update(f.keys())
    return keys


def _assert_loads_as(out: str, model: torch.nn.Module) -> None:
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(tokens).logits, loaded.eval()(tokens).logits
    assert want.dtype == got.dtype and torch.equal(want, got), (want - got).abs().max()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_no_missing_or_unexpected_key_and_bit_exact_logits(root, tmp_path, tie,
                                                                                            capsys):
    model = _llama(tie)
    _save(root, model)
    out = str(tmp_path / "hf")
    model.config.save_pretrained(out)  # the config first, as a user does: not an export, so no --force needed
    argv = ["--json", "export", "--format", "safetensors", "--keys", "model.*", "--strip-prefix", "model."]
    argv += ["--tie", "lm_head.weight=model.embed_tokens.weight"] if tie else []
    assert main(argv + [root, RUN, str(STEP), out]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == 1 and report["renamed"]["model.model.norm.weight"] == "model.norm.weight"
    keys = _exported_keys(out)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tie else set())
    assert keys == expected, keys ^ expected  # tied: written once, under the name save_pretrained keeps
    assert report["tied"] == ([["lm_head.weight", "model.embed_tokens.weight"]] if tie else [])
    _assert_loads_as(out, model)


def test_names_that_cannot_come_out_as_asked_are_refused_by_name_before_writing(root, tmp_path, capsys):
    model = _llama(False)
    _save(root, model)
    out = str(tmp_path / "hf")
    base = ["export", "--format", "safetensors", "--keys", "model.*"]

    assert main(base + ["--strip-prefix", "transformer.", root, RUN, str(STEP), out]) == 1
    err = capsys.readouterr().err
    assert "--strip-prefix 'transformer.'" in err and "matches no exported key" in err and "'model.model." in err

    assert main(base + ["--strip-prefix", "model.", "--rename", "model.layers.1.=model.layers.0.",
                        root, RUN, str(STEP), out]) == 1
    err = capsys.readouterr().err  # both stored keys that would share one name are named
    assert "'model.model.layers.0.self_attn.q_proj.weight' and 'model.model.layers.1.self_attn.q_proj.weight'" in err, err

    assert main(base + ["--strip-prefix", "model.", "--tie", "lm_head.weight=model.embed_tokens.weight",
                        root, RUN, str(STEP), out]) == 1
    err = capsys.readouterr().err  # untied weights: both are needed, so the tie is refused
    assert "not the same tensor" in err and "'model.lm_head.weight'" in err and "'model.model.embed_tokens.weight'" in err

    assert main(base + ["--tie", "lm_head.weight=model.embed_tokens.weight", root, RUN, str(STEP), out]) == 1
    assert "no exported key named ['lm_head.weight', 'model.embed_tokens.weight']" in capsys.readouterr().err

    assert main(["export", "--format", "safetensors", "--rename", "model", root, RUN, str(STEP), out]) == 2
    assert "OLD=NEW" in capsys.readouterr().err
    assert not os.path.exists(out), "a refused export writes nothing"


def test_an_existing_export_is_replaced_only_with_force(root, tmp_path, capsys):
    model = _llama(False)
    _save(root, model)
    out = str(tmp_path / "hf")
    model.config.save_pretrained(out)
    first = ["export", "--format", "safetensors", "--keys", "model.*", "--strip-prefix", "model.",
             "--shard-size", "20KB", root, RUN, str(STEP), out]
    assert main(first) == 0
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) > 2
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}

    second = ["export", "--format", "safetensors", "--keys", "model.*", "--strip-prefix", "model.",
              root, RUN, str(STEP), out]
    assert main(second) == 1
    err = capsys.readouterr().err
    assert "already holds an export" in err and "model.safetensors.index.json" in err and "--force" in err
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before

    assert main(second + ["--force"]) == 0  # one shard now: the earlier shards must not linger beside it
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model-00001-of-00001.safetensors",
                                       "model.safetensors.index.json"] or sorted(os.listdir(out)) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    _assert_loads_as(out, model)

    pt = str(tmp_path / "model.pt")
    assert main(["export", root, RUN, str(STEP), pt]) == 0
    assert main(["export", root, RUN, str(STEP), pt]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["export", root, RUN, str(STEP), pt, "--force"]) == 0


def test_transformers_is_a_test_extra_and_came_without_another_torch():
    """The test extra brings transformers; installing it must not have replaced the torch this project is tested on."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("transformers") for r in extras["test"]), extras["test"]
    assert torch.__version__.startswith("2.13.0"), torch.__version__
