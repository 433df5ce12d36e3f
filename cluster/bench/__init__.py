"""Benchmarks, run as `lorafleet bench {kernels,engine,http,suite,prefix,overhead}`; results
go to results/.

kernels.py  the multi-LoRA kernels against a per-sequence loop (and the base projection)
engine.py   the replica engine in-process: scenarios, ablations, the transformers + PEFT baseline
http.py     HTTP load against a running server (OpenAI API), per-request latencies
suite.py    starts the demo cluster and runs every HTTP scenario and ablation: JSON, table, plots
prefix.py   starts the demo cluster with the prefix cache on and off, 1 and 2 replicas
overhead.py one workload in-process and over HTTP on the same CPUs: what serving costs
stats.py    the percentiles, millisecond cells and machine description they share

The suite's plots and progress bar need the `bench` extra (matplotlib, tqdm); the rest runs
on a plain install.
"""
