"""The LoRA kernels benchmark's in-layer part on the CPU (interpreter, tiny shapes; timings meaningless): one policy
of each order (usual, write-first, the shrink inside the GEMM) runs between the base GEMMs, and the report has a
table per token count."""

from __future__ import annotations

import json
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"

from loraplex.bench import lora_kernels  # noqa: E402


def test_in_layer_only_runs_every_policy_for_each_token_count(tmp_path):
    out = tmp_path / "lk.json"
    assert lora_kernels.main(["--smoke", "--in-layer-only", "--in-layer-tokens", "24", "--reps", "1",
                              "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert "decode_step" not in payload  # --in-layer-only: the decode-step part did not run
    runs = [payload["in_layer"], *payload["in_layer_more"]]
    assert [r["tokens"] for r in runs] == [8, 24]
    for run in runs:
        policies = {r["policy"] for r in run["rows"]}
        # --smoke runs one policy of each order (every one is a name of the full run's list)
        assert policies == {"base only", *lora_kernels.SMOKE_IN_LAYER_POLICIES}, policies
        assert set(lora_kernels.SMOKE_IN_LAYER_POLICIES) <= {name for name, _ in lora_kernels.IN_LAYER_POLICIES}
        assert all(r["time_ms"] > 0 for r in run["rows"])
    # the smoke run's mixes (the full run's are 32 and 8 adapters)
    assert {r["adapters"] for r in runs[1]["rows"] if r["policy"] == "expand-first"} == {8, 2}
    md = out.with_suffix(".md").read_text()
    assert "one step of 8 tokens" in md and "one step of 24 tokens" in md and "| expand-first | 8 adapters |" in md


def test_in_layer_policies_names_the_unknown_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        lora_kernels.main(["--smoke", "--in-layer-only", "--in-layer-policies", "sequential,no such order",
                           "--out", str(tmp_path / "lk.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--in-layer-policies: unknown no such order" in err and "gemm shrink" in err


@pytest.mark.parametrize("policies, message", [
    ("default,no such policy", "--step-policies: unknown no such policy"),
    ("ticketed,ticketed-w2", "--step-policies must include default"),  # the report's target row is default's
])
def test_step_policies_are_checked_before_anything_runs(tmp_path, capsys, policies, message):
    with pytest.raises(SystemExit) as exc:
        lora_kernels.main(["--smoke", "--steps-only", "--step-policies", policies, "--out", str(tmp_path / "lk.json")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "lk.json").exists()
