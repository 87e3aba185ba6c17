"""Training a tiny model pair for dspark_rt: corpus, BPE tokenizer, Qwen3 target pretraining, and
DSpark / DFlash drafter training against the frozen target. Entry point: `main(argv)` in
dspark_rt/train/__main__.py (`dspark-rt train ...`, `python -m dspark_rt.train ...`)."""
