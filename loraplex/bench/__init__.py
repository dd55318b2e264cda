"""``loraplex bench``: offline and online throughput, the HBM roofline, paged attention against torch SDPA,
and the Hugging Face + PEFT peer, written as JSON + markdown to docs/benchmarks/."""
