"""One batched tokenizer call per step gives exactly the text of per-request incremental decoding."""

from __future__ import annotations

import random

from loraplex.engine.detokenizer import IncrementalDetokenizer, append_batch
from loraplex.engine.engine_core import load_tokenizer


def test_append_batch_equals_append_per_request(tiny_model):
    tokenizer = load_tokenizer(tiny_model["model_dir"])
    rng = random.Random(5)
    real = tokenizer.encode("Streaming text: déjà vu, 日本語, emoji 🎉 and\nnew lines.", add_special_tokens=False)
    prompts = [[rng.randrange(0, tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(40)]
    outputs = [real if i % 5 == 0 else [rng.randrange(0, tokenizer.vocab_size) for _ in range(len(real))]
               for i in range(40)]
    skips = [i % 3 != 0 for i in range(40)]  # both settings in one batch: two tokenizer calls
    one = [IncrementalDetokenizer(tokenizer, p, s) for p, s in zip(prompts, skips)]
    batched = [IncrementalDetokenizer(tokenizer, p, s) for p, s in zip(prompts, skips)]
    for step in range(len(real)):
        deltas = [d.append(out[step]) for d, out in zip(one, outputs)]
        append_batch(batched, [out[step] for out in outputs])
        assert [d.output_text for d in batched] == [d.output_text for d in one]
        assert all(d._new_text_start == e._new_text_start for d, e in zip(batched, one))
        assert any(deltas)
    assert one[0].output_text == tokenizer.decode(real)
