"""Benchmarks, run as `lorafleet bench {kernels,engine,http,suite}`; results go to results/.

kernels.py  the multi-LoRA kernels against a per-sequence loop (and the base projection)
engine.py   the replica engine in-process: scenarios, ablations, the transformers + PEFT baseline
http.py     HTTP load against a running server (OpenAI API), per-request latencies
suite.py    starts the demo cluster and runs every HTTP scenario and ablation: JSON, table, plots
stats.py    the percentiles, millisecond cells and machine description they share

The suite's plots and progress bar need the `bench` extra (matplotlib, tqdm); the rest runs
on a plain install.
"""
