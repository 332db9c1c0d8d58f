"""A/B benchmarks: llama-bench rounds, their statistics and limits, hit rates, paced rounds, first tokens."""
