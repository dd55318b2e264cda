"""The mixed-step LoRA benchmark on the CPU (interpreter, tiny shapes; timings meaningless): its step layouts put the
right tokens on the right adapters, a forced regime really changes the tiles, and the report is written."""

from __future__ import annotations

import json
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"

from loraplex.bench import mixed_step  # noqa: E402
from loraplex.kernels.lora_ops import choose_config  # noqa: E402


def test_layouts_put_one_token_per_decode_and_a_segment_per_prompt():
    slots, adapters = mixed_step.mixed_slots(3, 2, 5, [7, 8, 7, 9, 8])
    # requests 0..2 decode one token each; requests 3, 4 are prompt chunks of 5 tokens; ids -> slots by first use
    assert slots == [0, 1, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1] and adapters == 3
    mixes = {m["mix"]: m for m in mixed_step.build_mixes(256, 227, 29, 252)}
    assert mixes["distinct"]["adapters"] == 256 and len(mixes["distinct"]["slots"]) == 227 + 29 * 252
    assert mixes["one adapter"]["adapters"] == 1
    assert 1 < mixes["zipf 1.5 of 1000"]["adapters"] < 256
    assert len(mixes["prompts only, distinct"]["slots"]) == 29 * 252
    with pytest.raises(ValueError, match="do not fit 256 slots"):
        mixed_step.build_mixes(256, 250, 7, 10)


def test_regime_overrides_the_mean_tokens_per_adapter():
    # 7,535 tokens on 256 adapters: ~29 per adapter, decode tiles unless told otherwise
    assert choose_config(7535, 256, 256, 16, 4096, 3, 4096).block_m == 16
    assert choose_config(7535, 256, 256, 16, 4096, 3, 4096, regime="prefill").block_m == 64
    assert choose_config(7535, 8, 256, 16, 4096, 3, 4096, regime="decode").block_m == 16
    with pytest.raises(ValueError, match="regime"):
        choose_config(64, 64, 64, 16, 4096, 3, 4096, regime="fast")


def test_steps_below_the_token_floor_keep_the_decode_tiles():
    """Prefill tiles only from PREFILL_TILES_MIN_TOKENS tokens on (run 24: decode tiles were faster in every mix
    measured up to 3,072 tokens, even one 2,048-token prompt on one adapter), by mean or by long requests."""
    from loraplex.kernels.lora_ops import PREFILL_TILES_MIN_TOKENS as floor

    for tokens, adapters, long_tokens, want in [(512, 1, None, 16), (2048, 1, None, 16), (floor - 1, 1, None, 16),
                                                (floor, 1, None, 64), (7535, 47, None, 64),
                                                (2048, 201, 1848, 16), (7535, 256, 7308, 64), (7535, 256, 3000, 16)]:
        cfg = choose_config(tokens, adapters, 256, 16, 4096, 3, 4096, long_tokens=long_tokens)
        assert cfg.block_m == want, (tokens, adapters, long_tokens)


def test_smoke_run_writes_every_mix(tmp_path):
    out = tmp_path / "mixed.json"
    assert mixed_step.main(["--smoke", "--regimes", "auto", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["mix"] for r in payload["rows"]] == ["distinct", "zipf 1.5 of 1000", "one adapter",
                                                   "prompts only, distinct"]
    assert all(r["time_ms"] > 0 and r["regime"] == "auto" for r in payload["rows"])
    assert "| distinct | 23 | 3 | 1 × 20 |" in out.with_suffix(".md").read_text()


def test_unknown_regime_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mixed_step.main(["--smoke", "--regimes", "auto,fast", "--out", str(tmp_path / "m.json")])
    assert exc.value.code == 2 and "--regimes" in capsys.readouterr().err
