"""The demo model loads unchanged in transformers/PEFT, and its adapters change greedy output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, adapter_dir


def test_loads_with_hf_and_adapters_change_output(tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<s><|user|>Hello there<|end|><|assistant|>"
    ids = tok("The river runs past the old mill", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.rope_scaling["rope_type"] == "llama3"

    def greedy(m):
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                         do_sample=False, min_new_tokens=10)
        return out[0, ids.shape[1]:].tolist()

    base = greedy(model)
    outputs = {}
    for i in range(2):
        peft_model = PeftModel.from_pretrained(model, adapter_dir(tiny_model, i))
        outputs[i] = greedy(peft_model)
        model = peft_model.unload()  # back to the base model for the next adapter
    assert greedy(model) == base
    assert outputs[0] != base and outputs[1] != base and outputs[0] != outputs[1]


def test_adapters_have_mixed_ranks_and_nonzero_b(tiny_model):
    from safetensors import safe_open

    ranks = {a["rank"] for a in tiny_model["adapters"]}
    assert len(ranks) >= 4
    path = Path(adapter_dir(tiny_model, 0))
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["bias"] == "none"
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        b_keys = [k for k in f.keys() if "lora_B" in k]
        assert b_keys and all(f.get_tensor(k).abs().sum() > 0 for k in b_keys)


def test_demo_model_is_deterministic(tmp_path):
    from loraplex.demo import DemoModelSpec, build_demo_model

    for d in ("a", "b"):
        build_demo_model(tmp_path / d, DemoModelSpec(adapters=1, seed=7))
    for rel in ("model.safetensors", "tokenizer.json", "adapters/adapter-0/adapter_model.safetensors"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_cli_demo_model_and_qwen2(tmp_path):
    out = tmp_path / "qwen"
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "demo-model", str(out), "--arch", "qwen2", "--adapters", "1",
         "--layers", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 1


def test_bad_shape_is_a_clear_error(tmp_path):
    from loraplex.demo import DemoModelSpec, build_demo_model

    with pytest.raises(ValueError, match="heads"):
        build_demo_model(tmp_path, DemoModelSpec(hidden_size=64, heads=5))


def test_import_platform_is_stdlib():
    # run from the repository root, where a top-level platform/ package would shadow the stdlib
    proc = subprocess.run([sys.executable, "-c", "import platform; print(platform.python_implementation())"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() in ("CPython", "PyPy")


@pytest.mark.parametrize("flags, needle", [
    (["--layers", "0"], "--layers"),  # wrote a model without layers, exit 0
    (["--adapters", "-1"], "--adapters"),  # wrote no adapters, exit 0
    (["--hidden-size", "65"], "--hidden-size"),  # these three were tracebacks
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads"),
    (["--vocab-size", "10"], "--vocab-size"),
    (["--hidden-size", "24", "--heads", "8"], "--hidden-size / --heads must be even"),  # neither HF nor we ran it
])
def test_cli_bad_shape_flags_are_one_error_line(flags, needle, tmp_path, capsys):
    from loraplex.cli import main

    rc = main(["demo-model", str(tmp_path / "m"), "--adapters", "1", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraplex demo-model: error: ") and needle in lines[0], err
    assert not (tmp_path / "m").exists()  # refused before anything is written


def test_cli_never_writes_over_a_directory_that_is_not_a_demo_model(tmp_path, capsys):
    from loraplex.cli import main

    real = tmp_path / "my-model"  # someone's model: demo-model used to overwrite its weights and config
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "llama"}')
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for target in (real, a_file):
        rc = main(["demo-model", str(target), "--adapters", "0", "--layers", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err and str(target) in err, err
    assert (real / "config.json").read_text() == '{"model_type": "llama"}' and sorted(real.iterdir()) == [
        real / "config.json"]
    # an empty directory, or an earlier demo model, may be written
    (tmp_path / "empty").mkdir()
    assert main(["demo-model", str(tmp_path / "empty"), "--adapters", "0", "--layers", "1"]) == 0
    assert main(["demo-model", str(tmp_path / "empty"), "--adapters", "0", "--layers", "1", "--seed", "3"]) == 0


def test_rewriting_a_demo_model_leaves_no_adapter_of_the_earlier_one(tmp_path):
    """``demo-model DIR`` again with fewer adapters and another hidden size: DIR/adapters holds only the new
    adapters (the earlier ones no longer fit the base model, and the server imports every directory there); a
    directory the earlier manifest does not name is kept."""
    from safetensors import safe_open

    from loraplex.cli import main

    out = tmp_path / "demo"
    assert main(["demo-model", str(out), "--adapters", "3", "--layers", "1"]) == 0
    (out / "adapters" / "mine").mkdir()
    assert main(["demo-model", str(out), "--adapters", "1", "--layers", "1", "--hidden-size", "32"]) == 0
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["adapter-0", "mine"]
    with safe_open(str(out / "adapters" / "adapter-0" / "adapter_model.safetensors"), "pt") as f:
        a_keys = [k for k in f.keys() if "q_proj.lora_A" in k]
        assert a_keys and all(f.get_tensor(k).shape[1] == 32 for k in a_keys)
    assert [a["name"] for a in json.loads((out / "loraplex_demo.json").read_text())["adapters"]] == ["adapter-0"]
